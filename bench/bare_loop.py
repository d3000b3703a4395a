"""The bare reference for the simulation-overhead benchmark: FedAvg as a plain PyTorch loop.

    python -m bench.bare_loop --num-clients 10 --rounds 5 --threads 2 [--set key=value ...]

One process, no Flower: the clients are trained and evaluated one after another with the same
code for the math as the ClientApp and the FedAvg strategy (``fedfm_flower.models``,
``fedfm_flower.tasks.training``, ``fedfm_flower.data``, ``fedfm_flower.learners.aggregation``), in
client-id order. Preparing the clients' data is done before the
first round and is not timed; each round's time covers training every client, averaging, and
evaluating every client. The script checks at the end that no ``flwr`` module was imported.

Prints one JSON object: per-round seconds and accuracies, peak RSS, and the modules check.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from typing import Any

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.config.overrides import parse_overrides
from fedfm_flower.data import load_client_data
from fedfm_flower.learners.aggregation import weighted_average
from fedfm_flower.models import MODEL_CACHE, pick_device, prepare_foundation
from fedfm_flower.tasks.classification import ImageClassification
from fedfm_flower.tasks.training import evaluate, round_seed, train

SHARED = ("adapter", "head")  # what FedAvg sends both ways


def run_bare_fedavg(config: ExperimentConfig, num_clients: int, rounds: int) -> dict[str, Any]:
    """Run FedAvg for ``rounds`` rounds over ``num_clients`` clients; timings and accuracies."""
    prepare_foundation(config)  # as the ServerApp: an offline ViT's cache (built when missing)
    device = pick_device(config.device)
    prepare_started = time.perf_counter()
    data = [load_client_data(config, c, num_clients) for c in range(num_clients)]
    task = ImageClassification()
    model = MODEL_CACHE.get(config, "lora", data[0].num_classes, device)
    global_tensors = model.group_tensors(SHARED)
    prepare_seconds = time.perf_counter() - prepare_started
    records = []
    for server_round in range(1, rounds + 1):
        started = time.perf_counter()
        updates, weights = [], []
        for client in range(num_clients):
            model.load_tensors(global_tensors)
            train(
                task,
                model,
                data[client].train,
                model.group_parameters(SHARED).values(),
                config,
                seed=round_seed(config.seed, client, server_round),
                device=device,
            )
            updates.append(model.group_tensors(SHARED))
            weights.append(len(data[client].train))  # |D_i|, as the ClientApp reports
        global_tensors = weighted_average(updates, weights)
        model.load_tensors(global_tensors)
        accuracies = [
            evaluate(task, model, data[client].test, device=device).metrics["accuracy"]
            for client in range(num_clients)
        ]
        records.append(
            {
                "round": server_round,
                "round-seconds": time.perf_counter() - started,
                "test-accuracy-mean": statistics.fmean(accuracies),
                "test-accuracy": accuracies,
            }
        )
    return {"prepare-seconds": prepare_seconds, "rounds": records}


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = parse_overrides(args.set)
    config = ExperimentConfig.from_run_config(
        {
            **ExperimentConfig().to_run_config(),
            **overrides,
            "method": "fedavg",
            "num-clients": args.num_clients,
        }
    )
    result = run_bare_fedavg(config, args.num_clients, args.rounds)
    result["peak-rss-bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["flwr-imported"] = sorted(m for m in sys.modules if m == "flwr" or m.startswith("flwr."))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
