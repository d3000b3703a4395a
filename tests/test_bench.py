"""The benchmark suite's own pieces: the bare FedAvg reference and the byte counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from bench.bare_loop import run_bare_fedavg
from bench.communication import parameter_bytes, wire_bytes
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.config.overrides import parse_overrides, to_set_args
from fedfm_flower.records.messages import to_array_record
from server_apps.inprocess import run_in_process


def test_bare_loop_matches_the_framework_bit_for_bit(small_run_config: dict) -> None:
    """Same math, no Flower: the reference reaches exactly the framework's accuracies, so the
    overhead benchmark compares equal work."""
    config = {**small_run_config, "method": "fedavg", "num-server-rounds": 2}
    run_in_process(config, num_nodes=4)
    run_dir = next(Path(config["output-dir"]).glob("*/metrics.jsonl"))
    framework = [json.loads(line) for line in run_dir.read_text().splitlines()]
    experiment = ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **config})
    bare = run_bare_fedavg(experiment, num_clients=4, rounds=2)
    for ours, reference in zip(framework, bare["rounds"], strict=True):
        per_client = [ours["evaluate"][str(c)]["test-accuracy"] for c in range(4)]
        assert per_client == reference["test-accuracy"]


def test_wire_bytes_cover_the_parameters() -> None:
    tensors = {"a": torch.randn(64, 64), "b": torch.randn(10)}
    content = RecordDict({"arrays": to_array_record(tensors), "metrics": MetricRecord({"x": 1})})
    message = Message(content, dst_node_id=5, message_type="train")
    assert parameter_bytes(message) == (64 * 64 + 10) * 4
    wire = wire_bytes(message)
    assert parameter_bytes(message) < wire < parameter_bytes(message) + 4096
    empty = Message(
        RecordDict({"config": ConfigRecord({"k": 1})}), dst_node_id=5, message_type="train"
    )
    assert parameter_bytes(empty) == 0 and wire_bytes(empty) > 0


def test_overrides_round_trip() -> None:
    config = {"rounds": 3, "method": "fedrep", "flag": True, "lr": 0.05}
    args = to_set_args(config)
    assert parse_overrides(args[1::2]) == config


def test_pfedseq_step_benchmark_steps_past_the_warmup_with_history_on_the_server_device() -> None:
    """The benchmark's pre-filled window lives where step() appends (the server's device), and
    the timed step is the first one that infers calibrations (past the warm-up)."""
    from bench.pfedseq_server_step import build_server

    server = build_server(64, 3, 2, "cpu", "mamba", "torch", 0)
    assert all(h.device == server.device for h in server.history)
    stats = server.step({c: torch.full((64,), 1e-3) for c in range(3)}, dict.fromkeys(range(3), 8))
    assert stats["pfedseq-warmup"] == 0.0
    assert len(server.history) == 2  # the window stays at L rounds
    assert server.personal.shape == (3, 64) and torch.isfinite(server.personal).all()


def test_pfedseq_step_benchmark_puts_the_loop_and_the_batched_path_side_by_side() -> None:
    """Layers split D evenly; one table row per cell with both paths, their ratio and shares."""
    from bench.pfedseq_server_step import build_server, table

    loop = build_server(64, 3, 2, "cpu", "mamba", "torch", 0, 4, False)
    batched = build_server(64, 3, 2, "cpu", "mamba", "torch", 0, 4, True)
    assert [layer.size for layer in loop.layout.layers] == [16] * 4
    assert not loop.batch_layers and batched.batch_layers
    base = {"d": 4096, "n": 10, "l": 5, "layers": 4, "status": "ok", "peak_rss_increase_mib": 100}
    records = [
        {**base, "path": "loop", "step_seconds": 0.3, "chunks": 4, "chunk_rows": 1024},
        {**base, "path": "batched", "step_seconds": 0.2, "chunks": 1, "chunk_rows": 4096},
    ]
    text = table(records, "cpu", round_rest=0.7)
    assert (
        "| 4.1e+03 | 10 | 5 | 4 | 0.3 | 0.2 | 1.5 | 30.0% | 22.2% | 4 x 1024 / 1 x 4096 |" in text
    )
    earlier = {k: v for k, v in records[0].items() if k not in ("layers", "path")}
    assert "| 4.1e+03 | 10 | 5 | 1 | 0.3 | - | - | 4 x 1024 / - |" in table([earlier], "cpu")


def test_steady_round_leaves_out_the_start_up_and_the_final_evaluation_round() -> None:
    from bench.simulation_overhead import steady

    # Round 1 pays the start-up, round R the final evaluate-only phase.
    assert steady([9.0, 1.0, 3.0, 2.0, 8.0]) == 2.0
    assert steady([9.0, 1.0, 3.0, 8.0]) == 2.0
    assert steady([9.0, 1.0, 8.0]) == 1.0
    assert steady([9.0, 1.0]) == 1.0
    assert steady([9.0]) == 9.0


def test_gpu_share_gives_concurrent_clients_and_their_cpus() -> None:
    """Share f runs 1/f clients at once with usable CPUs * f each; a bad share names itself."""
    from bench.simulation_overhead import share_resources

    assert share_resources(0.0, 16) == (1, 16)
    assert share_resources(1.0, 16) == (1, 16)
    assert share_resources(0.25, 16) == (4, 4)
    assert share_resources(0.25, 2) == (4, 1)
    with pytest.raises(ValueError, match="1.5"):
        share_resources(1.5, 4)


def test_suite_tables_show_gpu_columns_and_unmeasured_memory() -> None:
    """GPU rows get backbone/share columns and GPU memory; unmeasured host memory reads n/a;
    a merge keeps the sections the new run did not measure."""
    from bench.suite import merge_results, tables

    run = {
        "steady-round-s": 2.0,
        "launch-s": 30.0,
        "round-s": [9.0, 2.0, 2.0],
        "peak-pss-bytes": None,
        "peak-processes": None,
        "peak-gpu-bytes": 3 << 30,
    }
    bare = {"steady-round-s": 1.6, "peak-pss-bytes": 2 << 30, "peak-gpu-bytes": 1 << 30}
    row = {
        "clients": 10,
        "backbone": "vit_small_patch16_224",
        "gpu-fraction": 0.25,
        "parallel-clients": 4,
        "bare": bare,
        "simulation": run,
        "steady-ratio": 1.25,
        "first-round-extra-s": 7.0,
        "same-accuracy": False,
        "accuracy-difference": 0.002,
    }
    machine = {"date": "d", "commit": "c", "cpus": 16, "processor": "x", "torch": "t", "gpu": "H"}
    earlier = {"mode": "gpu", "machine": machine, "seconds": 60.0, "server-cost": []}
    new = {"mode": "gpu", "machine": machine, "seconds": 120.0, "overhead": [row]}
    merged = merge_results(earlier, new)
    assert merged["seconds"] == 180.0 and "server-cost" in merged and "overhead" in merged
    text = tables(merged)
    assert "| vit_small_patch16_224 | 0.25 | 4 | 10 | 1.60 | 2.00 | 1.25 | 7.00 | 30.0 " in text
    assert "differs by 0.0020" in text
    assert "| 2048 | n/a | n/a | 1.00 | 3.00 |" in text


def test_pfedseq_report_reads_the_cosine_of_calibration_and_next_update() -> None:
    """cos(xi^{t-1}, Delta^t) from the logged surrogate and RMS values, against numpy."""
    from bench.pfedseq_report import alignments, client_accuracies

    g = torch.Generator().manual_seed(0)
    n, d = 3, 5
    xi = torch.randn(d, n, generator=g, dtype=torch.float64)
    delta = torch.randn(d, n, generator=g, dtype=torch.float64)
    records = [
        {
            "round": 11,
            "clients-reported": n,
            "server": {"pfedseq-calibration-rms": float(xi.pow(2).mean().sqrt())},
        },
        {
            "round": 12,
            "clients-reported": n,
            "server": {
                "pfedseq-surrogate": float((xi * delta).sum()),
                "pfedseq-update-rms": float(delta.pow(2).mean().sqrt()),
            },
            "evaluate": {
                "1": {"client-id": 1.0, "test-accuracy": 0.5},
                "0": {"client-id": 0.0, "test-accuracy": 0.25},
            },
        },
    ]
    cosine = float((xi * delta).sum() / (xi.norm() * delta.norm()))
    assert alignments(records, (n, d)) == {12: pytest.approx(cosine)}
    assert client_accuracies(records, 12) == [0.25, 0.5]
    assert client_accuracies(records, 11) is None


def test_compare_methods_checks_every_cell_before_running_any(tmp_path: Path, capsys) -> None:
    from bench import compare_methods

    code = compare_methods.main(
        ["--methods", "fedavg", "--seeds", "0", "--out", str(tmp_path), "--set", "lora-rank=-1"]
    )
    assert code == 2
    assert "run config 'lora-rank' = -1 is invalid" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_compare_methods_runs_the_other_cells_and_exits_1_when_one_fails(
    small_run_config: dict, tmp_path: Path, monkeypatch, capsys
) -> None:
    import server_apps.inprocess as inprocess
    from bench import compare_methods

    real = inprocess.run_in_process

    def failing_local(config, clients, *args, **kwargs):
        if config["method"] == "local":
            raise RuntimeError("round 1: no client returned a usable training reply")
        return real(config, clients, *args, **kwargs)

    monkeypatch.setattr(inprocess, "run_in_process", failing_local)
    common = [f"cache-dir={json.dumps(small_run_config['cache-dir'])}", "pretrain-epochs=30"]
    argv = ["--methods", "local", "fedavg", "--setups", "digits-label-skew", "--seeds", "0"]
    argv += ["--rounds", "1", "--clients", "4", "--out", str(tmp_path), "--set", *common]
    assert compare_methods.main(argv) == 1
    err = capsys.readouterr().err
    assert "FAILED local digits-label-skew seed 0: round 1: no client returned" in err
    assert "error: 1 of 2 runs failed" in err
    written = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in written["results"]] == ["fedavg"]  # the other cell ran
    assert written["failures"] == [
        {
            "method": "local",
            "setup": "digits-label-skew",
            "seed": 0,
            "error": "round 1: no client returned a usable training reply",
        }
    ]


def test_simulation_benchmark_fails_when_the_launcher_fails(tmp_path: Path) -> None:
    from bench.simulation_overhead import run_flower_simulation

    with pytest.raises(RuntimeError, match=r"failed \(2\)"):
        run_flower_simulation(2, 1, 1, {"method": "fedsgd"}, tmp_path, "bad")


def test_feddpa_inference_benchmark_writes_all_three_rows(cache_dir: Path, tmp_path: Path) -> None:
    """Tiny sizes on the CPU: both files, a row per variant, equal decoding work (no timings)."""
    from bench import feddpa_inference

    argv = ["--cache-dir", str(cache_dir), "--set", "pretrain-epochs=2", "--out", str(tmp_path)]
    argv += ["--prompts", "3", "--batch-size", "2", "--max-new-tokens", "3", "--repeats", "2"]
    assert feddpa_inference.main(argv) == 0
    results = json.loads((tmp_path / "results-cpu.json").read_text())
    rows = results["rows"]
    assert list(rows) == ["FedLoRA", "FedDPA (w/o auto)", "FedDPA"]
    for row in rows.values():
        assert len(row["per-repeat"]) == 2 and row["same-answers-as-fedlora"]
    assert 0.0 <= rows["FedDPA"]["mean-alpha"] <= 1.0
    assert results["settings"]["prompts"] == 3 and results["settings"]["instances"] == 5
    table = (tmp_path / "table-cpu.md").read_text()
    for name in ("| FedLoRA |", "| FedDPA (w/o auto) | ✗ |", "| FedDPA | ✓ |"):
        assert name in table


def test_message_cost_phases_are_exclusive_and_absorbing_phases_keep_nested_calls() -> None:
    """The per-message profile (bench.message_cost) counts each call to one phase only."""
    from bench.message_cost import PhaseClock

    clock = PhaseClock()
    leaf = clock.timed("leaf", lambda: sum(range(1000)), absorbs=True)
    hidden = clock.timed("hidden", lambda: sum(range(1000)), absorbs=True)
    absorbing = clock.timed("absorbing", lambda: hidden(), absorbs=True)
    outer = clock.timed("outer", lambda: (leaf(), absorbing()), absorbs=False)
    outer()
    seconds = clock.take()
    assert set(seconds) == {"outer", "leaf", "absorbing"}  # "hidden" ran inside "absorbing"
    assert all(value >= 0 for value in seconds.values())
    assert clock.take() == {}


def test_a_failed_suite_section_is_recorded_and_the_others_are_kept(monkeypatch) -> None:
    from bench import suite

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("launcher exited 3")

    rows = [{"method": "fedavg", "down-ratio": 0.7}]
    monkeypatch.setattr(suite.simulation_overhead, "measure", broken)
    monkeypatch.setattr(suite.communication, "measure", lambda methods, overrides: rows)
    results = suite.run_suite("quick", {}, ("overhead", "communication"))
    assert results["failed"] == {"overhead": "RuntimeError: launcher exited 3"}
    assert results["communication"] == rows and "overhead" not in results
    assert "**Section `overhead` failed:** RuntimeError: launcher exited 3" in suite.tables(
        {**results, "communication": []}
    )

    # Measuring the failed section again clears its failure; the other sections stay.
    again = {"mode": "quick", "seconds": 1.0, "sections": ["overhead"], "overhead": []}
    merged = suite.merge_results(results, again)
    assert "failed" not in merged and merged["communication"] == rows
    assert merged["sections"] == ["communication", "overhead"]


def test_cold_start_benchmark_runs_the_methods_the_default_model_serves() -> None:
    from bench.clientapp_cold_start import runnable_methods

    usable, refused = runnable_methods(None)
    assert {"fedavg", "pfedseq", "fedperfix"} <= set(usable)
    assert {"tap", "feddpa-t"} <= set(refused)
    assert "'feddpa-t'" in refused["feddpa-t"] and "text" in refused["feddpa-t"]
    assert runnable_methods(["fedrep", "tap"])[0] == ["fedrep"]


def test_engine_dispatch_benchmark_echoes_the_fedavg_payload_through_ray() -> None:
    from bench.engine_dispatch import measure

    result = measure(messages=4, warmup=1)
    assert result["messages"] == 4
    assert 0 < result["p10-ms"] <= result["median-ms"] <= result["p90-ms"]
    # LoRA A and B of the tiny ViT's 4 qkv layers (rank 4, width 64) and the 10-class head:
    # the parameter bytes the communication benchmark reports for FedAvg.
    assert result["payload-bytes"] == 4 * (4 * (4 * 64 + 192 * 4) + 10 * 64 + 10)


def test_the_load_sweep_stops_where_memory_would_run_out(monkeypatch, tmp_path) -> None:
    """bench.deployment_load: the next N is predicted from the last run's peak PSS and its
    per-node share; past the fraction of the available memory it is not started."""
    from bench import deployment_load

    ran: list[int] = []
    passed: set[tuple] = set()

    def fake_run(num_nodes: int, rounds: int, workdir, config, deploy, idle_s) -> dict:
        ran.append(num_nodes)
        passed.add((*sorted(deploy.items()), idle_s))
        return {
            "supernodes": num_nodes,
            "status": "finished:completed",
            "peak-pss-mb": 600.0 * (num_nodes + 1),  # 600 MB per process group
            "start-s": 1.0,
            "role-peak-pss-mb": {},
            "role-cpu-s": {},
        }

    monkeypatch.setattr(deployment_load, "run_load", fake_run)
    monkeypatch.setattr(deployment_load, "available_bytes", lambda: 10_000 * deployment_load.MB)
    deploy = {"superlink_database": ":flwr-in-memory:", "pull_patience": 300.0}
    rows = deployment_load.sweep([2, 4, 8, 16, 30], 3, tmp_path, {}, 0.8, deploy, 30.0)
    # 8 nodes: 5,400 MB predicted (fits 8,000); 16 nodes: 10,200 MB > 0.8 * 10,000
    assert ran == [2, 4, 8]
    assert passed == {(*sorted(deploy.items()), 30.0)}  # every run gets the same options
    assert rows[-1]["status"] == "not-started: memory" and rows[-1]["supernodes"] == 16
    assert rows[-1]["predicted-pss-mb"] == pytest.approx(600.0 * 17)
    assert "not-started: memory" in deployment_load.table(rows)


def test_the_gpu_modes_overhead_and_server_fraction_sections_run_a_timm_vit_on_the_cpu(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench.suite --gpu``'s first two sections on timm's ViT-S/16 with random weights, at
    32 px and 2 clients: the bare loop runs as the suite runs it (its own process), the
    simulations run the same run configs in process (`flwr run`'s launch is covered by
    test_simulation); every row has finite timings and its accuracies."""
    import math
    import time

    from bench import simulation_overhead, suite
    from fedfm_flower.models.threads import pinned_threads

    def in_process(
        num_clients: int,
        rounds: int,
        client_cpus: int,
        config: dict,
        workdir: Path,
        name: str,
        *rest: object,  # the GPU share and engine: the in-process grid has neither
    ) -> dict:
        run_config = simulation_overhead.simulation_run_config(num_clients, config, workdir, name)
        started = time.perf_counter()
        with pinned_threads(client_cpus):  # the threads Ray's clients would get
            run_in_process(run_config, num_nodes=num_clients)
        run_dir = Path(run_config["output-dir"]) / name
        return simulation_overhead.simulation_result(run_dir, rounds, time.perf_counter() - started)

    monkeypatch.setattr(simulation_overhead, "run_flower_simulation", in_process)
    monkeypatch.setattr(simulation_overhead, "usable_cpus", lambda: 1)  # no OpenMP spinning
    small = {
        "overhead": [(suite.VIT_S, [2])],
        "gpu-fractions": [0.0],
        "rounds": 2,
        "fraction-clients": 2,
        "fraction-methods": ["pfedpg"],
    }
    monkeypatch.setitem(suite.MODES, "gpu", {**suite.MODES["gpu"], **small})
    overrides = {
        "image-size": 32,
        "cache-dir": str(cache_dir),
        "local-steps": 1,
        "batch-size": 8,
        "public-fraction": 0.9,  # 2 clients of 90 digits each
    }
    results = suite.run_suite("gpu", overrides, ("overhead", "fraction"), tmp_path / "work")
    assert "failed" not in results, results.get("failed")
    [row] = results["overhead"]
    assert row["backbone"] == suite.VIT_S and row["clients"] == 2
    for side in (row["bare"], row["simulation"]):
        seconds = side["round-s"]
        assert len(seconds) == 2 and all(math.isfinite(s) and s > 0 for s in seconds)
        assert 0.0 <= side["final-accuracy"] <= 1.0
    assert math.isfinite(row["steady-ratio"]) and row["same-accuracy"]  # same math both sides
    fractions = {r["method"]: r for r in results["server-fraction"]}
    assert set(fractions) == {"fedavg", "pfedpg"}
    for fraction in fractions.values():
        assert fraction["backbone"] == suite.VIT_S and fraction["clients"] == 2
        assert math.isfinite(fraction["fraction"]) and 0 < fraction["fraction"] < 1
    assert "(2 clients, vit_small_patch16_224" in suite.tables(results)


def test_cpu_by_role_sums_roles_and_keeps_what_an_exited_process_used() -> None:
    import os
    import subprocess
    import sys
    import time

    from bench.process_cpu import CpuByRole
    from fedfm_flower.simulation.processes import cpu_seconds

    # The child burns past 0.4 s: /proc counts in clock ticks, so a child that stopped at its
    # precise 0.3 s could read 0.29 there forever.
    burn = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"
    child = subprocess.Popen([sys.executable, "-c", burn + "input()"], stdin=subprocess.PIPE)
    try:
        cpu = CpuByRole()
        deadline = time.monotonic() + 60  # a child that dies or stalls fails, never hangs
        while cpu_seconds(child.pid) < 0.3:
            cpu.record(child.pid, "worker")
            assert child.poll() is None, f"the burning child exited early ({child.returncode})"
            assert time.monotonic() < deadline, (
                f"the child used {cpu_seconds(child.pid):.2f} CPU s in 60 s "
                f"(/proc/{child.pid}/stat: {open(f'/proc/{child.pid}/stat').read()!r})"
            )
            time.sleep(0.001)
        cpu.record(child.pid, "worker")
        used = cpu.by_role()["worker"]
    finally:
        child.communicate(b"\n")
    cpu.record(child.pid, "worker")  # gone: its last reading stays
    cpu.record(os.getpid(), "driver")
    assert cpu.role(child.pid) == "worker" and cpu.role(-1) is None
    assert cpu.by_role()["worker"] == used >= 0.3
    assert cpu.by_role()["driver"] == pytest.approx(cpu_seconds(os.getpid()), abs=0.05)
    assert cpu.processes() == {"driver": 1, "worker": 1}


def test_the_load_bench_reads_set_values_quoted_or_bare(monkeypatch, tmp_path, capsys) -> None:
    from bench import deployment_load

    seen = {}

    def fake_sweep(supernodes, rounds, workdir, config, fraction, deploy, idle_s):  # noqa: ANN001, ANN202
        seen.update(config)
        seen["idle"] = idle_s
        return []

    monkeypatch.setattr(deployment_load, "sweep", fake_sweep)
    monkeypatch.setattr(deployment_load, "exit_on_sigterm", lambda: None)
    sets = ["partitioner=iid", "dataset='digits'", "num-server-rounds=3", "lr=0.01"]
    argv = ["--supernodes", "2", "--workdir", str(tmp_path)]
    assert deployment_load.main([*argv, *(a for s in sets for a in ("--set", s))]) == 0
    expected = {"partitioner": "iid", "dataset": "digits", "num-server-rounds": 3, "lr": 0.01}
    assert seen == {**expected, "idle": 0.0}
    with pytest.raises(SystemExit) as exit_:
        deployment_load.main([*argv, "--set", "no-value"])
    assert exit_.value.code == 2 and "'no-value'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        deployment_load.main([*argv, "--idle-seconds", "-1"])
    assert exit_.value.code == 2 and "must lie in [0, 3600]" in capsys.readouterr().err
