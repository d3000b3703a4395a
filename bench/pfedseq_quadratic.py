"""pFedSeq's server settings compared on the synthetic quadratic federation, in seconds per run.

    python -m bench.pfedseq_quadratic                 # the table in docs/methods/pfedseq.md
    python -m bench.pfedseq_quadratic --rounds 40 --seeds 0 1 2

Each row runs the server step (``fedfm_flower.learners.pfedseq``) on
``fedfm_flower.learners.quadratic``'s federation of 10 clients with the paper's learner settings
(2-layer Mamba, Adam 1e-3, W = 10, L = 10) and one setting changed, and reports the personalized
error relative to FedAvg's (the same server with the learner never used; < 1 is better) and
the calibration/update RMS ratio, per round after the warm-up, mean over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from fedfm_flower.learners.pfedseq import PFedSeqSettings
from fedfm_flower.learners.quadratic import QuadraticFederation, fedavg_settings, run_quadratic

ROOT = Path(__file__).resolve().parent.parent
SETTINGS: dict[str, dict] = {
    "default (input none, output zero)": {},
    "input-scale rms": {"input_scale": "rms"},
    "input-scale rms-rescale (earlier default)": {"input_scale": "rms-rescale"},
    "output-init reference (Gu & Dao)": {"output_init": "reference"},
    "output-init reference, input rms": {"output_init": "reference", "input_scale": "rms"},
    "learner-update mini-batch (32 rows)": {"learner_update": "mini-batch"},
    "variant C (no cross-client)": {"cross_client": False},
}


def settings_for(changes: dict) -> PFedSeqSettings:
    """The paper's settings with ``changes`` (PFedSeqSettings fields)."""
    return PFedSeqSettings(seq_len=10, warmup_rounds=10, lr=1e-3, **changes)


def main(argv: list[str] | None = None) -> None:
    """Run every setting over the seeds; print and write a markdown table and JSON."""
    parser = argparse.ArgumentParser(description="pFedSeq settings on a quadratic federation")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--only", nargs="*", default=None, help="setting names to run")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "pfedseq_quadratic"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shown = (11, 15, 20, 30, args.rounds)
    lines = [
        "| setting | "
        + " | ".join(f"error/FedAvg r{r}" for r in shown)
        + " | "
        + " | ".join(f"ratio r{r}" for r in shown)
        + " |",
        "|---|" + "---|" * (2 * len(shown)),
    ]
    results = {}
    for name, changes in SETTINGS.items():
        if args.only and name not in args.only:
            continue
        settings = settings_for(changes)
        relative, ratios = [], []
        for seed in args.seeds:
            federation = QuadraticFederation(seed=seed)
            run = run_quadratic(settings, federation, args.rounds)
            base = run_quadratic(fedavg_settings(settings, args.rounds), federation, args.rounds)
            relative.append([a / b for a, b in zip(run.errors, base.errors, strict=True)])
            ratios.append(run.ratios)
        mean = lambda rows, r: statistics.fmean(row[r - 1] for row in rows)  # noqa: E731
        results[name] = {"relative-error": relative, "ratio": ratios}
        lines.append(
            f"| {name} | "
            + " | ".join(f"{mean(relative, r):.3g}" for r in shown)
            + " | "
            + " | ".join(f"{mean(ratios, r):.3g}" for r in shown)
            + " |"
        )
        print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results})
    )
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
