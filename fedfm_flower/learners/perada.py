"""The server half of PerAda (Xie et al., CVPR 2024) on tensors, without any Flower code: the
ensemble distillation of the clients' adapters into the global adapter on auxiliary data.

Given the averaged global tensors w_bar, the tensors w_i the reporting clients returned and an
unlabelled auxiliary set, ``EnsembleDistiller.distill`` runs ``perada-kd-steps`` steps of Adam
(step size ``perada-kd-lr`` cosine-annealed to 0) on
``softened_kl(mean_i f(x; w_i), f(x; w), T)`` over the trainable tensors w of one model whose
frozen backbone is the clients' (the student starts at w_bar). The rule and its choices are in
``fedfm_flower.methods.perada``; the strategy is ``strategies.perada``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data import public_sample_ids
from fedfm_flower.data.images import normalize
from fedfm_flower.data.loaders import load_source
from fedfm_flower.data.settings import DataSettings
from fedfm_flower.data.source import Source
from fedfm_flower.methods.perada import PerAdaSettings
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.distillation import softened_kl


@dataclass(frozen=True)
class AuxiliarySet:
    """Unlabelled auxiliary inputs: their number, and the model inputs at some positions."""

    size: int
    inputs: Callable[[torch.Tensor], torch.Tensor]  # positions in [0, size) -> model inputs


def auxiliary_set(config: ExperimentConfig) -> AuxiliarySet:
    """The auxiliary set ``perada-aux-data`` names: a public split (pretraining and test parts
    together, labels dropped) or a whole other dataset, normalized as the clients' inputs; its
    pixels are decoded on demand. An empty one is a ConfigError naming the key."""

    settings = config.settings_of(PerAdaSettings)
    choice = settings.aux_data
    if choice == "cifar10":
        source = whole_dataset(config, choice, settings.aux_dir)
        ids = np.arange(len(source))
    else:
        # glyph-domains' public split is fixed by the dataset, whatever the run's partitioner;
        # the run's own data directory and id column are its dataset's, not the embedded glyphs'.
        owner = (
            config
            if choice == "public"
            else config.replace(dataset="glyph-domains", data_dir="", natural_id_column="")
        )
        ids = np.sort(np.concatenate(public_sample_ids(owner)))
        if len(ids) == 0:
            raise ConfigError(
                PerAdaSettings.key_of("aux_data"),
                choice,
                f"the public split of dataset '{owner.dataset}' is empty (public-fraction = "
                f"{owner.public_fraction}); raise public-fraction or choose 'glyphs'",
            )
        source = load_source(DataSettings.from_config(owner))

    def inputs(rows: torch.Tensor) -> torch.Tensor:
        return normalize(source.images(ids[rows.numpy()]))

    return AuxiliarySet(len(ids), inputs)


def whole_dataset(config: ExperimentConfig, dataset: str, data_dir: str) -> Source:
    """The source of every image of ``dataset`` (read from ``data_dir``, else by Hub name) at
    the run's image size; refused when the run's own clients hold that dataset."""
    if config.dataset == dataset:
        raise ConfigError(
            PerAdaSettings.key_of("aux_data"),
            dataset,
            f"the run's clients hold {dataset}'s images, and the auxiliary set must be data no "
            "client holds: choose 'public' (its held-out public split)",
        )
    if data_dir and not Path(data_dir).expanduser().is_dir():
        raise ConfigError(PerAdaSettings.key_of("aux_dir"), data_dir, "no such directory")
    own = DataSettings.from_config(config)
    return load_source(
        dataclasses.replace(own, dataset=dataset, data_dir=data_dir, natural_id_column="")
    )


def kd_batches(size: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """The positions of ``steps`` batches: passes over ``range(size)`` in fresh seeded random
    orders, a pass's last batch possibly smaller."""
    generator = torch.Generator().manual_seed(seed)
    batches: list[torch.Tensor] = []
    while len(batches) < steps:
        order = torch.randperm(size, generator=generator)
        batches.extend(order[start : start + batch_size] for start in range(0, size, batch_size))
    return batches[:steps]


def cosine_factor(step: int, steps: int) -> float:
    """The step size multiplier of step ``step`` (from 0) of ``steps``: cosine from 1 to 0
    (``torch.optim.lr_scheduler.CosineAnnealingLR`` with ``T_max = steps``, ``eta_min = 0``)."""
    return 0.5 * (1.0 + math.cos(math.pi * step / steps))


class EnsembleDistiller:
    """Distils the mean logits of client models into the global model on auxiliary inputs."""

    def __init__(
        self,
        model: TunedModel,
        auxiliary: AuxiliarySet,
        settings: PerAdaSettings,
        device: torch.device,
    ) -> None:
        self.model = model
        self.auxiliary = auxiliary
        self.settings = settings
        self.device = device

    def teacher_logits(
        self, teachers: Sequence[dict[str, torch.Tensor]], rows: torch.Tensor
    ) -> torch.Tensor:
        """The mean over ``teachers`` of the model's logits at auxiliary positions ``rows``
        (eval mode, no gradients), on the CPU."""
        model, chunk = self.model, self.settings.kd_batch_size
        model.eval()
        parts = []
        with torch.no_grad():
            for start in range(0, len(rows), chunk):
                x = self.auxiliary.inputs(rows[start : start + chunk]).to(self.device)
                total = None
                for tensors in teachers:
                    model.load_tensors(tensors)
                    logits = model(x).float()
                    total = logits if total is None else total + logits
                parts.append((total / len(teachers)).cpu())
        return torch.cat(parts)

    def distill(
        self,
        start: dict[str, torch.Tensor],
        teachers: Sequence[dict[str, torch.Tensor]],
        seed: int,
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The student's tensors after the distillation steps from ``start`` towards the
        ensemble of ``teachers`` (each holding ``start``'s names), in ``start``'s dtypes; the
        round's distillation statistics."""
        if not teachers:
            raise ValueError("PerAda's distillation needs at least one client model")
        started = time.perf_counter()
        settings, model = self.settings, self.model
        steps = settings.kd_steps
        batches = kd_batches(self.auxiliary.size, settings.kd_batch_size, steps, seed)
        used = torch.unique(torch.cat(batches))
        position = torch.full((self.auxiliary.size,), -1, dtype=torch.long)
        position[used] = torch.arange(len(used))
        targets = self.teacher_logits(teachers, used)

        model.load_tensors(start)
        params = model.parameters_named(start)
        for p in params.values():
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(params.values(), lr=settings.kd_lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: cosine_factor(step, steps)
        )
        torch.manual_seed(seed)  # dropout in the student, if the model has any
        model.train()
        losses = []
        for rows in batches:
            x = self.auxiliary.inputs(rows).to(self.device)
            target = targets[position[rows]].to(self.device)
            optimizer.zero_grad(set_to_none=True)
            loss = softened_kl(target, model(x).float(), settings.kd_temperature)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
        model.eval()
        result = {n: p.detach().cpu().to(start[n].dtype).clone() for n, p in params.items()}
        return result, {
            "perada-kd-loss-first": losses[0],
            "perada-kd-loss-last": losses[-1],
            "perada-kd-teachers": float(len(teachers)),
            "perada-kd-rows": float(len(used)),
            "perada-kd-seconds": time.perf_counter() - started,
        }
