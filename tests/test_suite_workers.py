"""The suite's split over pytest-xdist workers (tests/workers.py): the tests that start real
processes form one unit of work, every other test is a unit of its own."""

from __future__ import annotations

from pathlib import Path

from tests.workers import PROCESS_MODULES, work_unit

TESTS = Path(__file__).parent


def test_every_process_module_is_a_test_module_here() -> None:
    missing = sorted(m for m in PROCESS_MODULES if not (TESTS / f"{m}.py").is_file())
    assert not missing, f"PROCESS_MODULES names no such test module: {missing}"


def test_process_tests_share_one_unit_and_the_others_are_their_own() -> None:
    assert work_unit("tests/test_faults.py::test_a[x]") == "processes"
    assert work_unit("tests/test_chaos.py::TestChaos::test_b") == "processes"
    assert work_unit("tests/test_config.py::test_c") == "tests/test_config.py::test_c"
    # a module whose name only starts like a process module's is not one
    assert work_unit("tests/test_faults_report.py::test_d") == "tests/test_faults_report.py::test_d"
