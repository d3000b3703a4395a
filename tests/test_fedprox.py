"""FedProx: mu = 0 is FedAvg bit for bit; the proximal gradient against a hand computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client_apps.fedprox import FedProxClient
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.fedprox import FedProxSettings
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import numpy_arrays
from fedfm_flower.records.results import RunDirectory
from server_apps.inprocess import run_in_process
from tests.tiny_clients import LinearModel, ce_grads, client_runtime


def _trained(mu: float, received: dict[str, torch.Tensor], tmp_path: Path) -> dict:
    """FedProx's client trains the linear model for two full-batch SGD steps from ``received``."""
    config = ExperimentConfig(
        method="fedprox", lr=0.5, batch_size=32, local_steps=2, momentum=0.0
    ).replace(fedprox_mu=mu)
    runtime = client_runtime(LinearModel(), config, tmp_path / str(mu))
    sent, _ = FedProxClient().train(runtime, received, 1)
    return sent


def test_the_proximal_gradient_matches_a_hand_computation(tmp_path: Path) -> None:
    mu, lr = 0.8, 0.5
    w0 = {n: t + 0.3 for n, t in LinearModel().trainable().tensors.items()}
    received = {n: t.clone() for n, t in w0.items()}
    sent = _trained(mu, received, tmp_path)
    # Every step sees the whole train split (22 examples, batch 32): order does not matter.
    runtime = client_runtime(LinearModel(), ExperimentConfig(), tmp_path / "data")
    batch = tuple(torch.stack(column) for column in zip(*runtime.data.train, strict=True))
    names = ("head.weight", "head.bias")
    # Step 1 starts at w0, where the proximal term's gradient mu (w - w0) is zero.
    grads = ce_grads(w0[names[0]], w0[names[1]], batch)
    w1 = {n: w0[n] - lr * g for n, g in zip(names, grads, strict=True)}
    grads = ce_grads(w1[names[0]], w1[names[1]], batch)
    w2 = {n: w1[n] - lr * (g + mu * (w1[n] - w0[n])) for n, g in zip(names, grads, strict=True)}
    plain = {n: w1[n] - lr * g for n, g in zip(names, grads, strict=True)}
    for name in names:
        assert torch.allclose(sent[name], w2[name], atol=1e-6)
        assert (sent[name] - plain[name]).abs().max() > 1e-3  # the term is visible
    assert all(torch.equal(received[n], w0[n]) for n in names)  # the anchor is untouched


def _untimed(per_client: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The per-client metrics without wall-clock times."""
    return {
        c: {k: v for k, v in m.items() if not k.endswith("-seconds")} for c, m in per_client.items()
    }


def test_mu_zero_trains_exactly_as_fedavg(small_run_config: dict, tmp_path: Path) -> None:
    runs = {}
    for method in ("fedavg", "fedprox"):
        config = {
            **small_run_config,
            "method": method,
            "fedprox-mu": 0.0,
            "run-name": method,
            "client-state-dir": str(tmp_path / method),
        }
        summary, grid = run_in_process(config, num_nodes=4)
        sent = [
            numpy_arrays(m.content.array_records[P.ARRAYS])
            for m in grid.sent
            if m.metadata.message_type == "train"
        ]
        records = RunDirectory(Path(config["output-dir"]) / summary["run-name"]).rounds()
        runs[method] = (records, sent)
    (avg_records, avg_sent), (prox_records, prox_sent) = runs["fedavg"], runs["fedprox"]
    for ours, theirs in zip(avg_records, prox_records, strict=True):
        assert _untimed(ours["train"]) == _untimed(theirs["train"])  # per-client train loss
        assert ours["evaluate"] == theirs["evaluate"]  # per-client test loss and accuracy
    # Every round's global tensors (what the server sends) are equal bit for bit.
    assert len(avg_sent) == len(prox_sent) > 0
    for ours, theirs in zip(avg_sent, prox_sent, strict=True):
        assert ours.keys() == theirs.keys()
        assert all((ours[n] == theirs[n]).all() for n in ours)


def test_mu_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="fedprox-mu"):
        ExperimentConfig().replace(fedprox_mu=-0.1).settings_of(FedProxSettings)
