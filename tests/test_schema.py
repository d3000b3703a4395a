"""One declared schema: every key declared once, its copies generated and kept current."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedfm_flower.config.experiment import GROUPS, ExperimentConfig
from fedfm_flower.config.keys import QUANTIZATION_LEVELS
from fedfm_flower.config.schema import (
    TABLE_HEADER,
    WRITE_COMMAND,
    docs_table,
    key_groups,
    main,
    pyproject_table,
    stale_files,
    toml_value,
    with_docs_tables,
    with_pyproject_table,
)
from fedfm_flower.methods.registry import settings_classes
from fedfm_flower.methods.settings import ConfigError, allowed_values, check_value, setting

ROOT = Path(__file__).resolve().parent.parent


def test_the_committed_copies_are_generated_from_the_schema() -> None:
    """pyproject.toml's run config and docs/configuration.md's key tables are the schema's."""
    stale = stale_files(ROOT)
    assert not stale, f"{', '.join(stale)} differ from the declared keys; run: {WRITE_COMMAND}"
    assert main(["--check", "--root", str(ROOT)]) == 0


def test_every_key_is_declared_once_with_a_doc() -> None:
    groups = key_groups()
    names = [key.name for group in groups for key in group.keys]
    assert len(names) == len(set(names)) == len(ExperimentConfig.keys())
    assert names == list(ExperimentConfig.keys())  # the schema's order is the config's
    assert len({group.name for group in groups}) == len(groups)
    for group in groups:
        assert group.keys, group.name
        for key in group.keys:
            assert key.doc.strip() and "\n" not in key.doc, f"{key.name}: declare doc=..."
            assert "|" not in key.doc.replace("\\|", ""), f"{key.name}: a '|' breaks the table"
    common = [g.name for g in groups[: len(GROUPS)]]
    assert common == [g.group for g in GROUPS]
    assert [g.name for g in groups[len(GROUPS) :]] == [k.prefix for k in settings_classes()]


def test_the_config_inherits_every_group_in_order() -> None:
    fields = [f.name for f in dataclasses.fields(ExperimentConfig)]
    declared = [f.name for group in GROUPS for f in dataclasses.fields(group)]
    assert fields == [*declared, "method_values"]
    assert ExperimentConfig().lora_rank == 4  # a tuner group's field, read flat


def test_the_pyproject_table_parses_to_the_defaults_and_leaves_the_rest() -> None:
    table = tomllib.loads(pyproject_table())["tool"]["flwr"]["app"]["config"]
    assert table == ExperimentConfig().to_run_config()
    assert list(table) == list(ExperimentConfig.keys())
    text = f'[project]\nname = "x"\n\n{TABLE_HEADER}\ngone = 1\n\n[tool.ruff]\nline-length = 100\n'
    new = with_pyproject_table(text)
    assert new.startswith('[project]\nname = "x"\n\n' + pyproject_table() + "\n")
    assert new.endswith("\n[tool.ruff]\nline-length = 100\n") and "\ngone = 1" not in new
    assert with_pyproject_table(new) == new
    with pytest.raises(ValueError, match="one"):
        with_pyproject_table('[project]\nname = "x"\n')


def test_docs_blocks_are_regenerated_and_every_group_needs_one() -> None:
    names = [group.name for group in key_groups()]
    block = "".join(f"<!-- keys: {name} -->\nstale\n<!-- /keys -->\nprose\n" for name in names)
    new = with_docs_tables(f"intro\n{block}")
    assert "stale" not in new and new.startswith("intro\n") and new.count("prose\n") == len(names)
    assert docs_table(["federation"]) in new
    assert "| `num-server-rounds` | `20` | communication rounds (> 0) |" in new
    with pytest.raises(ValueError, match="missing: federation"):
        with_docs_tables(block.replace("<!-- keys: federation -->", "<!-- keys: data -->"))
    with pytest.raises(ValueError, match="do not exist: colour"):
        with_docs_tables(block.replace("keys: federation", "keys: federation colour"))


def test_toml_values() -> None:
    assert [toml_value(v) for v in (True, 3, 1e-5, 0.5, 'a"b')] == [
        "true",
        "3",
        "1e-05",
        "0.5",
        '"a\\"b"',
    ]


@pytest.mark.parametrize(
    ("bounds", "inside", "outside", "rule"),
    [
        ("[]", (0, 1), (-0.1, 1.1), "must lie in [0, 1] (why)"),
        ("(]", (0.5, 1), (0, 1.5), "must lie in (0, 1] (why)"),
        ("[)", (0, 0.5), (1, -1), "must lie in [0, 1) (why)"),
        ("()", (0.5,), (0, 1), "must lie in (0, 1) (why)"),
    ],
)
def test_intervals_include_the_ends_their_bounds_say(
    bounds: str, inside: tuple, outside: tuple, rule: str
) -> None:
    @dataclasses.dataclass(frozen=True)
    class Group:
        share: float = setting(0.5, within=(0, 1), bounds=bounds, note="why", doc="a share")

    (f,) = dataclasses.fields(Group)
    for value in inside:
        check_value("share", value, f)
    for value in outside:
        with pytest.raises(ConfigError) as info:
            check_value("share", value, f)
        assert str(info.value) == f"run config 'share' = {value!r} is invalid: {rule}"


def test_choices_from_a_registry_are_read_when_checked() -> None:
    from fedfm_flower.data.registry import DATASETS
    from fedfm_flower.methods.registry import METHODS
    from fedfm_flower.models.families import BACKBONES

    fields = {f.name: f for f in dataclasses.fields(ExperimentConfig)}
    assert allowed_values(fields["dataset"]) == tuple(DATASETS)
    assert allowed_values(fields["backbone"]) == BACKBONES
    assert allowed_values(fields["method"]) == tuple(METHODS)
    with pytest.raises(ValueError, match="bounds"):
        setting(0.5, bounds="[[")


def test_the_quantization_bound_is_the_secagg_modulus_over_1024_clients() -> None:
    from fedfm_flower.privacy.secagg import MODULUS_RANGE

    assert QUANTIZATION_LEVELS == MODULUS_RANGE // 1024
    with pytest.raises(ConfigError, match=r"must lie in \(1, 4194304\]"):
        ExperimentConfig.from_run_config({"secagg-quantization-range": 2**22 + 1})


def test_the_schema_imports_neither_torch_nor_flwr() -> None:
    """The ClientApp parses the run config per message: the declarations stay light."""
    script = (
        "import sys, json\n"
        "from fedfm_flower.config.schema import key_groups, pyproject_table\n"
        "assert len(key_groups()) > 10 and pyproject_table()\n"
        "print(json.dumps(sorted(m for m in ('torch', 'flwr', 'numpy') if m in sys.modules)))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []


def test_every_key_table_in_the_docs_states_the_declared_defaults() -> None:
    """The methods' pages keep key tables of their own (what each key means in the paper):
    each row names a declared key and its default as the schema writes it (other pages' tables
    may list node-config keys)."""
    defaults = {key.name: toml_value(key.default) for g in key_groups() for key in g.keys}
    checked = 0
    for path in sorted((ROOT / "docs").rglob("*.md")):
        in_table = False
        for line in path.read_text().splitlines():
            if line.startswith("| key | default |"):
                in_table = True
            elif not line.startswith("|"):
                in_table = False
            elif in_table and not line.startswith("|---"):
                key, default = (cell.strip() for cell in line.split("|")[1:3])
                where = f"{path.relative_to(ROOT)}: {key}"
                if key.strip("`") not in defaults:
                    assert path.parent.name != "methods", f"{where} is not a declared key"
                    continue
                stated = default.split("`")[1] if "`" in default else default
                expected = defaults[key.strip("`")]
                assert stated.strip('"') == expected.strip('"'), f"{where}: default {default}"
                checked += 1
    assert checked > len(defaults)  # the generated tables and the methods' own
