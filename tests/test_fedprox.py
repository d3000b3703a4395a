"""FedProx: mu = 0 is FedAvg bit for bit; the proximal gradient against a hand computation, for
FedProx and for FedAvg-FT's federated training (``fedavg-ft-prox-mu``, FedDPA's Table 8 row
FedLoRA under FedProx), whose fine-tuning takes no term."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client_apps.fedavg_ft import FedAvgFineTuneClient
from client_apps.fedprox import FedProxClient
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.fedavg_ft import FedAvgFTSettings
from fedfm_flower.methods.fedprox import FedProxSettings
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import numpy_arrays
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.study.sweep import cell_config
from server_apps.inprocess import run_in_process
from tests.tiny_clients import LinearModel, ce_grads, client_runtime

# method -> (its client, the run-config key of its mu in snake case)
PROXIMAL = {
    "fedprox": (FedProxClient, "fedprox_mu"),
    "fedavg-ft": (FedAvgFineTuneClient, "fedavg_ft_prox_mu"),
}


def _config(method: str, mu: float) -> ExperimentConfig:
    config = ExperimentConfig(method=method, lr=0.5, batch_size=32, local_steps=2, momentum=0.0)
    return config.replace(**{PROXIMAL[method][1]: mu})


def _trained(
    mu: float, received: dict[str, torch.Tensor], tmp_path: Path, method: str = "fedprox"
) -> dict:
    """The method's client trains the linear model for two full-batch SGD steps from
    ``received``."""
    runtime = client_runtime(LinearModel(), _config(method, mu), tmp_path / f"{method}-{mu}")
    sent, _ = PROXIMAL[method][0]().train(runtime, received, 1)
    return sent


@pytest.mark.parametrize("method", list(PROXIMAL))
def test_the_proximal_gradient_matches_a_hand_computation(method: str, tmp_path: Path) -> None:
    mu, lr = 0.8, 0.5
    w0 = {n: t + 0.3 for n, t in LinearModel().trainable().tensors.items()}
    received = {n: t.clone() for n, t in w0.items()}
    sent = _trained(mu, received, tmp_path, method)
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


def test_fedavg_ft_fedprox_variant_and_its_untouched_fine_tuning(tmp_path: Path) -> None:
    """``fedavg-ft:fedprox`` (Table 8's FedLoRA) sets mu = 0.01, plain fedavg-ft 0; at 0 it
    sends what FedAvg's local step sends; the fine-tuning before an evaluation takes no term
    (the same received tensors evaluate alike at any mu)."""
    for label, mu in (("fedavg-ft:fedprox", 0.01), ("fedavg-ft", 0.0)):
        cell = cell_config(label, "feddpa-flan-dataset1", 0, tmp_path)
        cell["data-dir"] = str(tmp_path)  # the authors' files are the user's: any directory
        parsed = ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **cell})
        assert parsed.settings_of(FedAvgFTSettings).prox_mu == mu, label
    received = {n: t + 0.3 for n, t in LinearModel().trainable().tensors.items()}
    plain = _trained(0.0, received, tmp_path / "ft", "fedavg-ft")
    fedavg = _trained(0.0, received, tmp_path / "prox", "fedprox")  # mu 0: FedAvg bit for bit
    assert all(torch.equal(plain[n], fedavg[n]) for n in plain)
    evaluations = []
    for mu in (0.0, 0.8):
        config = _config("fedavg-ft", mu).replace(finetune_steps=2)
        runtime = client_runtime(LinearModel(), config, tmp_path / f"eval-{mu}")
        evaluations.append(FedAvgFineTuneClient().evaluate(runtime, received, 1))
    assert evaluations[0] == evaluations[1]
    with pytest.raises(ConfigError, match="fedavg-ft-prox-mu"):
        _config("fedavg-ft", -0.1).settings_of(FedAvgFTSettings)
