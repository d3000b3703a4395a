"""Per-client resources of each method: storage, computation, communication (FedPerfix's Table 2).

    python -m fedfm_flower.study.resources --setup cifar100-dir0.1-vit-s16 --methods fedavg local \\
        apfl per-fedavg fedperfix:fedbn fedbabu fedrep fedperfix:vanilla-attention fedperfix
    python -m fedfm_flower.study.resources --methods fedperfix --set tuner=none \\
        fedperfix-personal=vit.norm --label fedbn --format csv

Every number is counted on the model the run would build (``build_model(...,
load_weights=False)`` on PyTorch's meta device: shapes only, no weights, no download):

* **storage**: the parameters a client holds: every parameter of its model (a frozen backbone
  included) plus, for a method that keeps more than one copy of the trainable tensors (APFL: a
  personal and a global model), the extra copies, plus the parameter groups it keeps a second
  copy of (FedRoD's personal head), plus the method's own scalars (APFL's alpha): the method's
  ``ResourceProfile`` (``fedfm_flower/methods/<method>.py``);
* **computation**: multiply-accumulates (MACs) of one training step per sample: the MACs of one
  sample's forward pass times the forward-backward passes per step (APFL and Per-FedAvg: 2).
  A forward's MACs are those of every matrix product: linear layers (tokens x in x out),
  convolutions (outputs x in/groups x kernel), the attention products ``QK^T`` and ``AV``
  (heads x queries x keys x head width each) and any other matmul; element-wise work (norms,
  activations, softmax, biases) is not counted. The backward pass is not counted separately
  (about twice the forward when the whole model trains, the same factor for every such method,
  so the ratios hold);
* **communication**: the parameters a client uploads per round, the tensors its method shares
  (the method's split, ``MethodSpec.split``; FedPerfix's from ``fedperfix-personal``), and
  the parameters it downloads: as many (pFedSeq and pFedPG send updates of the shared tensors,
  of the same size) except where the method's profile counts its messages (``traffic``: APPLE
  downloads every client's core, PeFLL's messages carry its networks' descriptor, gradient and
  Jacobian).

Each is also given as a fraction of FedAvg's on the same backbone: FedAvg training the whole
ViT with no plugin (``tuner = none``, ``train-backbone = true``), the paper's 1x. FedPerfix's
numbers for ViT-S/16 (21.03M, 20.66M, 13.89M, 24.42M) are parameters in units of 2^20 with
timm's 1000-class head: ``--num-classes 1000 --units binary`` reproduces them. Its FLOPs
(65.65M for ViT-S) come from a counting tool and are not reproduced; its percentages are.

Run configs are layered as in ``fedfm_flower.study.sweep``: with ``--setup``, the setup's file and
the method's file for it, then ``configs/<method>/<variant>.toml`` for ``method:variant``, then the
``--set`` overrides (for every row); ``--label`` renames the rows.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import io
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.config.files import CONFIG_ROOT
from fedfm_flower.config.overrides import parse_overrides
from fedfm_flower.data.registry import dataset_spec
from fedfm_flower.methods.registry import method_spec, resolve
from fedfm_flower.models.build import build_model
from fedfm_flower.models.families import family_of
from fedfm_flower.models.groups import in_groups
from fedfm_flower.study.sweep import cell_config


@dataclass(frozen=True)
class Resources:
    """One method's per-client resources on one model, and FedAvg's on the same backbone."""

    label: str
    method: str
    backbone: str
    image_size: int
    num_outputs: int
    storage_params: int  # parameters a client holds
    local_params: int  # of which never sent (personal, or FedBABU's frozen head; APFL's v, alpha)
    upload_params: int  # parameters sent to the server per round
    download_params: int  # parameters received from the server per round
    forward_macs: int  # MACs of one sample's forward pass
    passes: int  # forward-backward passes per training step
    fedavg_storage_params: int
    fedavg_upload_params: int
    fedavg_train_macs: int

    @property
    def train_macs(self) -> int:
        """Training MACs per sample and step: forward MACs x passes."""
        return self.forward_macs * self.passes

    @property
    def storage_ratio(self) -> float:
        """Storage as a fraction of FedAvg's."""
        return self.storage_params / self.fedavg_storage_params

    @property
    def computation_ratio(self) -> float:
        """Training MACs as a fraction of FedAvg's."""
        return self.train_macs / self.fedavg_train_macs

    @property
    def communication_ratio(self) -> float:
        """Upload per round as a fraction of FedAvg's."""
        return self.upload_params / self.fedavg_upload_params

    @property
    def download_equals_upload(self) -> bool:
        """Whether the server sends as many parameters as the client uploads."""
        return self.download_params == self.upload_params


# ---------------------------------------------------------------------------------------------
# Counting multiply-accumulates


def _out_times_inner(out: torch.Tensor, a: torch.Tensor, *_: Any, **__: Any) -> int:
    return out.numel() * (a.shape[-1] if a.dim() else 1)


def _linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *_: Any, **__: Any) -> int:
    return out.numel() * weight.shape[-1]


def _conv(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *_: Any, **__: Any) -> int:
    return out.numel() * weight[0].numel()  # outputs x in/groups x kernel


def _addmm(out: torch.Tensor, _input: torch.Tensor, a: torch.Tensor, *_: Any, **__: Any) -> int:
    return out.numel() * a.shape[-1]


def _attention(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any, **__: Any
) -> int:
    rows = out.numel() // v.shape[-1]  # batch x heads x queries
    return rows * k.shape[-2] * (q.shape[-1] + v.shape[-1])  # QK^T and AV


_MAC_RULES = {
    F.linear: _linear,
    F.conv1d: _conv,
    F.conv2d: _conv,
    F.conv3d: _conv,
    F.scaled_dot_product_attention: _attention,
    torch.matmul: _out_times_inner,
    torch.Tensor.matmul: _out_times_inner,
    torch.Tensor.__matmul__: _out_times_inner,
    torch.mm: _out_times_inner,
    torch.Tensor.mm: _out_times_inner,
    torch.bmm: _out_times_inner,
    torch.Tensor.bmm: _out_times_inner,
    torch.addmm: _addmm,
    torch.Tensor.addmm: _addmm,
    torch.baddbmm: _addmm,
    torch.Tensor.baddbmm: _addmm,
}


class _MacCounter(TorchFunctionMode):
    """Adds up the MACs of the matrix products (``_MAC_RULES``) run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.macs = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rule = _MAC_RULES.get(func)
        if rule is not None:
            self.macs += int(rule(out, *args, **kwargs))
        return out


def forward_macs(module: Callable[..., Any], *inputs: torch.Tensor) -> int:
    """MACs of ``module(*inputs)``: linear, convolution, attention and other matrix products."""
    with torch.no_grad(), _MacCounter() as counter:
        module(*inputs)
    return counter.macs


# ---------------------------------------------------------------------------------------------
# Counting on a method's model


@dataclass(frozen=True)
class _ModelCounts:
    total_params: int
    numel: Mapping[str, int]  # trainable (grouped) parameter -> elements, in model order
    groups: Mapping[str, str]  # trainable parameter -> group
    forward_macs: int


def _model_key(config: ExperimentConfig) -> ExperimentConfig:
    # Only the model's shape matters (the tuner and whether the backbone trains are passed on
    # their own; weights are never loaded): rows differing in the rest share one count. A
    # family that takes some tuners only (a ResNet: none) validates with its first.
    tuners = family_of(config.backbone).tuners
    return dataclasses.replace(
        config,
        method="fedavg",
        label="",
        setup="",
        run_name="",
        method_values=(),
        seed=0,
        tuner=tuners[0] if tuners else "auto",
        train_backbone=False,
        pretrained=False,
        weights_file="",
    )


@functools.lru_cache(maxsize=16)
def _model_counts(
    key: ExperimentConfig, tuner: str, num_outputs: int, train_backbone: bool
) -> _ModelCounts:

    def count(device: str) -> _ModelCounts:
        with torch.device(device):
            model = build_model(
                key, tuner, num_outputs, load_weights=False, train_backbone=train_backbone
            ).eval()
            size = key.image_size
            macs = forward_macs(model, torch.zeros(1, 3, size, size))
        groups = model.parameter_groups()  # BatchNorm statistics too: they travel
        params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        return _ModelCounts(
            sum(p.numel() for p in params.values()),
            {n: params[n].numel() for n in groups},
            groups,
            macs,
        )

    try:  # shapes only: fast, and no memory for ViT-B's weights
        return count("meta")
    except (NotImplementedError, RuntimeError):  # an op without a meta kernel
        return count("cpu")


def _num_outputs(config: ExperimentConfig, num_outputs: int | None) -> int:
    if num_outputs is not None:
        return num_outputs

    return dataset_spec(config.dataset).num_classes  # no data is read


def method_resources(config: ExperimentConfig, num_outputs: int | None = None) -> Resources:
    """Storage, computation and communication per client of ``config``'s method and model."""
    if family_of(config.backbone).modality != "image":
        raise ValueError(f"backbone '{config.backbone}': resources are counted for ViTs only")
    method = resolve(config)
    profile = method.spec.profile
    outputs = _num_outputs(config, num_outputs)
    counts = _model_counts(_model_key(config), method.tuner, outputs, method.trains_backbone)
    shared, local = method.split_names(counts.groups)
    if (profile.traffic is not None or callable(profile.copies)) and not config.num_clients:
        raise ValueError(
            f"method '{config.method}': what a client stores or sends grows with the number "
            "of clients; set num-clients"
        )
    trainable = sum(counts.numel.values())
    copied = sum(
        counts.numel[n] for n, g in counts.groups.items() if in_groups(g, profile.copied_groups)
    )
    extra_copies = (profile.copies_for(config) - 1) * trainable
    storage = counts.total_params + extra_copies + copied + profile.extra
    upload = download = sum(counts.numel[n] for n in shared)
    if profile.traffic is not None:
        upload, download = profile.traffic(config, upload, outputs)
    reference = _model_counts(_model_key(config), "none", outputs, True)
    return Resources(
        label=config.label or config.method,
        method=config.method,
        backbone=config.backbone,
        image_size=config.image_size,
        num_outputs=outputs,
        storage_params=storage,
        local_params=sum(counts.numel[n] for n in local) + storage - counts.total_params,
        upload_params=upload,
        download_params=download,
        forward_macs=counts.forward_macs,
        passes=profile.passes,
        fedavg_storage_params=reference.total_params,
        fedavg_upload_params=sum(reference.numel.values()),
        fedavg_train_macs=reference.forward_macs * method_spec("fedavg").profile.passes,
    )


def resources_table(
    configs: Iterable[ExperimentConfig], num_outputs: int | None = None
) -> list[Resources]:
    """``method_resources`` of every config, in order (models of equal shape are counted once)."""
    return [method_resources(config, num_outputs) for config in configs]


# ---------------------------------------------------------------------------------------------
# The command


def run_config_of(
    label: str,
    overrides: Mapping[str, Any] | None = None,
    setup: str = "",
    configs: Path = CONFIG_ROOT,
) -> dict[str, Any]:
    """The run config of one row ``method[:variant]``, layered as in
    ``fedfm_flower.study.sweep``."""
    if setup:
        return cell_config(label, setup, 0, Path("runs"), dict(overrides or {}), configs=configs)
    method, _, variant = label.partition(":")
    config: dict[str, Any] = {}
    if variant:
        variant_file = configs / method / f"{variant}.toml"
        if not variant_file.is_file():
            raise FileNotFoundError(f"variant '{label}': {variant_file} does not exist")
        config.update(tomllib.loads(variant_file.read_text()))
    return {**config, **(overrides or {}), "method": method, "label": label}


def _amount(value: float, units: str) -> str:
    base, names = (1024, ("Ki", "Mi", "Gi")) if units == "binary" else (1000, ("k", "M", "G"))
    for power, name in zip((3, 2, 1), reversed(names), strict=True):
        if value >= base**power:
            return f"{value / base**power:.2f}{name}"
    return f"{value:.0f}"


def _percent(ratio: float) -> str:
    percent = 100 * ratio
    return f"{percent:.2g}%" if 0 < percent < 1 else f"{percent:.1f}%"


def format_markdown(rows: list[Resources], units: str = "si") -> str:
    """The table in Markdown, percentages of FedAvg's in brackets, with its definitions."""
    lines = [
        "| Method | Storage (params) | Computation (MACs / sample / step) "
        "| Communication (params / round) |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        cells = (
            (r.storage_params, r.storage_ratio),
            (r.train_macs, r.computation_ratio),
            (r.upload_params, r.communication_ratio),
        )
        text = " | ".join(f"{_amount(v, units)} ({_percent(ratio)})" for v, ratio in cells)
        lines.append(f"| {r.label} | {text} |")
    models = dict.fromkeys((r.backbone, r.image_size, r.num_outputs) for r in rows)
    on = "; ".join(f"`{b}` at {s} px, {n} outputs" for b, s, n in models)
    same = all(r.download_equals_upload for r in rows)
    lines += [
        "",
        f"Model: {on}. Percentages: of FedAvg training the whole model with no plugin. "
        "Storage: parameters a client holds (its model, extra copies of the trainable tensors, "
        "method scalars). Computation: MACs of one sample's forward pass (linear, convolution "
        "and attention products) x forward-backward passes per step. Communication: parameters "
        f"uploaded per round{'; the download is the same size' if same else ''}."
        + (" Ki, Mi, Gi: 2^10, 2^20, 2^30." if units == "binary" else ""),
    ]
    return "\n".join(lines)


def format_csv(rows: list[Resources]) -> str:
    """The table as CSV: raw counts and ratios to FedAvg's."""

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        (
            "label",
            "method",
            "backbone",
            "image_size",
            "num_outputs",
            "storage_params",
            "storage_vs_fedavg",
            "forward_macs_per_sample",
            "passes",
            "train_macs_per_sample",
            "computation_vs_fedavg",
            "upload_params",
            "download_params",
            "communication_vs_fedavg",
            "local_params",
        )
    )
    for r in rows:
        writer.writerow(
            (
                r.label,
                r.method,
                r.backbone,
                r.image_size,
                r.num_outputs,
                r.storage_params,
                f"{r.storage_ratio:.6f}",
                r.forward_macs,
                r.passes,
                r.train_macs,
                f"{r.computation_ratio:.6f}",
                r.upload_params,
                r.download_params,
                f"{r.communication_ratio:.6f}",
                r.local_params,
            )
        )
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    """Print the resources table; exit status 0, or 2 for a bad argument or config."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.study.resources", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--methods", nargs="+", required=True, help="method or method:variant")
    parser.add_argument("--setup", default="", help="configs/setups/<name>.toml (optional)")
    parser.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--label", nargs="+", default=[], help="row names, one per method")
    parser.add_argument("--num-classes", type=int, default=None, help="default: the dataset's")
    parser.add_argument("--format", choices=("md", "csv"), default="md")
    parser.add_argument("--units", choices=("si", "binary"), default="si", help="M = 10^6 or 2^20")
    parser.add_argument("--configs", type=Path, default=CONFIG_ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.label and len(args.label) != len(args.methods):
        parser.error(f"--label: {len(args.label)} names for {len(args.methods)} methods")
    try:
        overrides = parse_overrides(args.set)
        configs = []
        for i, label in enumerate(args.methods):
            run_config = run_config_of(label, overrides, args.setup, args.configs)
            if args.label:
                run_config["label"] = args.label[i]
            configs.append(ExperimentConfig.from_run_config(run_config))
        rows = resources_table(configs, args.num_classes)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_markdown(rows, args.units) if args.format == "md" else format_csv(rows), end="")
    if args.format == "md":
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
