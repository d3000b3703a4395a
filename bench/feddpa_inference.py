"""FedDPA's Table 13: inference seconds per instance with and without the dynamic weighting.

    python -m bench.feddpa_inference                      # tiny LLaMA, CPU, client 0's prompts
    python -m bench.feddpa_inference --batch-size 8 --max-new-tokens 16 --repeats 3
    python -m bench.feddpa_inference --device cuda --model-name-or-path huggyllama/llama-7b

One client's test prompts of the offline instruction data (``dataset = instructions``, FedDPA's
prompt template) are answered by greedy generation (``fedfm_flower.models.language.generate``)
in three ways, on one backbone with LoRA on ``q_proj,v_proj``:

* ``FedLoRA``: one LoRA adapter (tuner ``lora``);
* ``FedDPA (w/o auto)``: the global and local adapters (tuner ``dual-lora``) mixed with the
  fixed weights (1 - alpha, alpha) (``adapter_mix``; Table 3's "w/o Auto");
* ``FedDPA``: the same model in ``InstanceWeightedLM``: per prompt, S local training instances
  and the prompt are embedded with the global adapter and alpha_t is lambda times their mean
  cosine similarity (sec. 4.3). A fresh wrapper per pass, as a client builds one per
  evaluation: each sampled training instance is embedded once per pass (its cache).

The adapters keep their seeded initialisation (LoRA's B = 0): every variant computes its
adapters in full, but all three decode the same tokens, so the rows do equal decoding work
(the table shows the answers' tokens per instance, EOS not counted). A timed pass answers
every prompt in batches of ``--batch-size``; a row's figure is the median over ``--repeats``
passes of the pass's seconds divided by the number of prompts, after one untimed warm-up batch
per variant. The variants take turns within each repeat (the order rotates), so drifting
background load falls on all three alike. ``x FedLoRA`` is a row's median over FedLoRA's.

The default backbone is the offline ``tiny-llama`` (built into ``--cache-dir`` on first use,
about a minute per 16 epochs on a CPU; ``--set pretrain-epochs=2`` and other run-config keys
override ``BASE_CONFIG``); ``--model-name-or-path`` switches to ``hf-causal-lm``
(a Hugging Face name or local directory, e.g. LLaMA-7B as in the paper). Both models are held
at once (their backbones are separate copies). Writes ``results-<device>.json`` and
``table-<device>.md`` under ``--out`` (default ``bench/results/feddpa_inference``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.utils.data import TensorDataset

    from fedfm_flower.config.experiment import ExperimentConfig

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "feddpa_inference"
FEDLORA = "FedLoRA"
FIXED = "FedDPA (w/o auto)"
DYNAMIC = "FedDPA"
VARIANTS: tuple[str, ...] = (FEDLORA, FIXED, DYNAMIC)
AUTO = {FEDLORA: "", FIXED: "✗", DYNAMIC: "✓"}
# The offline instruction setup (configs/fedavg/instructions.toml): its cached foundation model.
BASE_CONFIG: dict[str, Any] = {
    "method": "feddpa-f",
    "dataset": "instructions",
    "backbone": "tiny-llama",
    "num-clients": 8,
    "pretrain-epochs": 16,
    "lora-target-modules": "q_proj,v_proj",
    "lora-rank": 8,
    "lora-alpha": 16.0,
    "max-length": 96,
}


def experiment_config(args: argparse.Namespace) -> ExperimentConfig:
    """The run config of the benchmark's models and data (``ExperimentConfig``)."""
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.config.overrides import parse_overrides

    run_config = {
        **ExperimentConfig().to_run_config(),
        **BASE_CONFIG,
        **parse_overrides(args.set),
        "cache-dir": args.cache_dir,
        "device": args.device,
        "seed": args.seed,
        "batch-size": args.batch_size,
        "max-new-tokens": args.max_new_tokens,
    }
    if args.model_name_or_path:
        run_config |= {"backbone": "hf-causal-lm", "model-name-or-path": args.model_name_or_path}
    return ExperimentConfig.from_run_config(run_config)


def synchronize(device: str) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def timed(run: Callable[[], list[str]], device: str) -> tuple[float, list[str]]:
    """(wall seconds, answers) of one call of ``run``."""
    synchronize(device)
    started = time.perf_counter()
    answers = run()
    synchronize(device)
    return time.perf_counter() - started, answers


def variant_runners(
    config: ExperimentConfig, args: argparse.Namespace, train: TensorDataset
) -> tuple[dict[str, Callable[[list[str]], list[str]]], list[float]]:
    """{variant: answer these prompts} and a list holding the alpha_t of FedDPA's last pass."""
    from fedfm_flower.models import build_model
    from fedfm_flower.models.dynamic_mix import InstanceWeightedLM
    from fedfm_flower.models.language.generate import generate
    from fedfm_flower.models.tuners.dual_lora import GLOBAL, LOCAL, adapter_mix

    device = torch.device(args.device)
    lora = build_model(config, "lora").to(device).eval()
    dual = build_model(config, "dual-lora").to(device).eval()
    alphas: list[float] = []

    def answer(model: Any, some: list[str]) -> list[str]:
        return generate(model, model.tokenizer, some, args.max_new_tokens, args.batch_size, device)

    def fixed(some: list[str]) -> list[str]:
        with adapter_mix(dual, {GLOBAL: 1.0 - args.alpha, LOCAL: args.alpha}):
            return answer(dual, some)

    def dynamic(some: list[str]) -> list[str]:
        weighted = InstanceWeightedLM(
            dual,
            train,
            instances=args.instances,
            similarity="cosine",
            representation="last",
            scale=args.scale,
            seed=args.seed,
            batch_size=args.batch_size,
        )
        answers = answer(weighted, some)
        alphas[:] = weighted.alphas
        return answers

    runners = {FEDLORA: lambda some: answer(lora, some), FIXED: fixed, DYNAMIC: dynamic}
    return runners, alphas


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Time every variant on one client's test prompts; the results as a JSON-able dict."""
    from fedfm_flower.models.causal_lm import tokenizer_of
    from fedfm_flower.models.language.encoding import encode_prompts
    from fedfm_flower.tasks.instructions import InstructionFollowing

    config = experiment_config(args)
    data = InstructionFollowing().client_data(config, args.client, config.num_clients)
    examples = data.test.examples[: args.prompts or None]
    prompts = encode_prompts(None, examples)
    runners, alphas = variant_runners(config, args, data.train)
    for variant in VARIANTS:  # untimed: lazy initialisation, allocator, kernels
        runners[variant](prompts[: args.batch_size])
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    answers: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        turn = repeat % len(VARIANTS)
        for variant in VARIANTS[turn:] + VARIANTS[:turn]:
            elapsed, out = timed(lambda v=variant: runners[v](prompts), args.device)
            seconds[variant].append(elapsed / len(prompts))
            answers.setdefault(variant, out)
        print(
            f"repeat {repeat + 1}/{args.repeats}: "
            + ", ".join(f"{v} {seconds[v][-1]:.4f} s" for v in VARIANTS),
            flush=True,
        )
    encode = tokenizer_of(config)  # to count the answers' tokens
    median = {v: statistics.median(seconds[v]) for v in VARIANTS}
    rows = {
        v: {
            "seconds-per-instance": median[v],
            "ratio-to-fedlora": median[v] / median[FEDLORA],
            "per-repeat": seconds[v],
            "answer-tokens-per-instance": statistics.fmean(
                len(encode(a, add_special_tokens=False)["input_ids"]) for a in answers[v]
            ),
            "same-answers-as-fedlora": answers[v] == answers[FEDLORA],
        }
        for v in VARIANTS
    }
    rows[DYNAMIC]["mean-alpha"] = statistics.fmean(alphas) if alphas else None
    return {
        "settings": {
            "backbone": config.backbone,
            "model-name-or-path": config.model_name_or_path,
            "client": args.client,
            "task": data.task,
            "prompts": len(prompts),
            "batch-size": args.batch_size,
            "max-new-tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "device": args.device,
            "alpha": args.alpha,
            "instances": args.instances,
            "scale": args.scale,
            "lora-rank": config.lora_rank,
            "lora-target-modules": config.lora_target_modules,
            "seed": args.seed,
        },
        "rows": rows,
    }


def machine_info(device: str) -> dict[str, Any]:
    """Platform, CPUs, torch and threads, GPU, date and git commit of this run."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_commit": commit.stdout.strip(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def table(results: dict[str, Any]) -> str:
    """Markdown: one row per variant, seconds per instance and the ratio to FedLoRA."""
    s = results["settings"]
    lines = [
        f"{s['backbone']} {s['model-name-or-path']}".strip()
        + f", client {s['client']} ({s['task']}), {s['prompts']} prompts, batch {s['batch-size']},"
        f" max-new-tokens {s['max-new-tokens']}, S = {s['instances']}, alpha = {s['alpha']},"
        f" {s['device']}, median of {s['repeats']} passes.",
        "",
        "| method | auto | s / instance | × FedLoRA | answer tokens / instance |",
        "|---|:---:|---:|---:|---:|",
    ]
    for variant, row in results["rows"].items():
        lines.append(
            f"| {variant} | {AUTO[variant]} | {row['seconds-per-instance']:.4f} | "
            f"{row['ratio-to-fedlora']:.2f} | {row['answer-tokens-per-instance']:.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate call")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes (median)")
    parser.add_argument("--prompts", type=int, default=0, help="test prompts used; 0 = all")
    parser.add_argument("--client", type=int, default=0, help="whose test prompts and pool")
    parser.add_argument("--instances", type=int, default=5, help="S of sec. 4.3")
    parser.add_argument("--alpha", type=float, default=0.5, help="the fixed local weight")
    parser.add_argument("--scale", type=float, default=1.0, help="lambda of sec. 4.3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = default")
    parser.add_argument(
        "--model-name-or-path", default="", help="a Hugging Face causal LM (hf-causal-lm)"
    )
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "fedfm-flower"))
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config overrides"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    for name in ("batch_size", "max_new_tokens", "repeats", "instances"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.prompts < 0 or args.threads < 0:
        parser.error("--prompts and --threads must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure the three variants; print and write the table and the JSON."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results = measure(args)
    results["machine"] = machine_info(args.device)
    results["seconds"] = time.perf_counter() - started
    markdown = table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"results-{args.device}.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / f"table-{args.device}.md").write_text(markdown + "\n")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
