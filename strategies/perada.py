"""PerAda's server (Xie et al. 2024): FedAvg of the clients' global adapters w_i, then ensemble
distillation of the w_i into the average on unlabelled auxiliary data.

``aggregate`` first takes FedAvg's weighted average of the replies (``FedAvgStrategy``), then,
in the rounds that distil (``perada-kd-steps`` > 0, within ``perada-kd-rounds``), moves it by
``fedfm_flower.learners.perada.EnsembleDistiller`` with the reporting clients' returned tensors
as the teacher ensemble. The distiller holds the run's own model (frozen backbone, tuner,
head), built on the server on first use, and the auxiliary set ``perada-aux-data``, located at
start (so a bad choice fails before round 1). Each round's distillation is seeded by the run's
seed and the round only and starts a fresh optimizer, so the state is FedAvg's global tensors
alone and a resumed run distils as an uninterrupted one. The personal adapters never reach the
server. The settings and choices are in ``fedfm_flower.methods.perada``.
"""

from __future__ import annotations

import logging

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.learners.perada import AuxiliarySet, EnsembleDistiller, auxiliary_set
from fedfm_flower.methods.perada import PerAdaSettings
from fedfm_flower.models import TrainableTensors, TunedModel, build_model, pick_device
from fedfm_flower.tasks import task_of
from fedfm_flower.tasks.training import round_seed
from strategies.fedavg import FedAvgStrategy
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.exchange import PLAIN_ROUND, RoundInputs
from strategies.parts.replies import ClientReply

log = logging.getLogger(__name__)

SERVER = -1  # the "client id" of the server's own seeds (clients' ids are >= 0)
KD_SALT = 7


class PerAdaStrategy(FedAvgStrategy):
    """FedAvg's average of the w_i, improved by distillation from their ensemble."""

    def __init__(
        self, config: ExperimentConfig, initial: TrainableTensors, context: RunContext = NO_CONTEXT
    ) -> None:
        super().__init__(config, initial, context)
        self.settings = config.settings_of(PerAdaSettings)
        self.device = pick_device(config.device)
        distils = self.settings.kd_steps > 0
        self.auxiliary = self.auxiliary_set() if distils else None
        self._distiller: EnsembleDistiller | None = None

    def auxiliary_set(self) -> AuxiliarySet:
        """The run's auxiliary set (``perada-aux-data``)."""
        return auxiliary_set(self.config)

    def distillation_model(self) -> TunedModel:
        """The run's model on the server: the clients' frozen backbone, tuner and head."""

        outputs = task_of(self.config).num_outputs(self.config)
        model = build_model(
            self.config,
            self.method.tuner,
            outputs,
            train_backbone=self.method.trains_backbone,
        )
        return model.to(self.device)

    def distiller(self) -> EnsembleDistiller:
        """The distiller, its model built on first use."""
        if self._distiller is None:
            assert self.auxiliary is not None  # built whenever kd-steps > 0
            self._distiller = EnsembleDistiller(
                self.distillation_model(), self.auxiliary, self.settings, self.device
            )
        return self._distiller

    def aggregate(
        self, server_round: int, replies: list[ClientReply], inputs: RoundInputs = PLAIN_ROUND
    ) -> dict[str, float]:
        """FedAvg's average of the replies, then (in a distilling round) the distillation of
        the replies' ensemble into it; FedAvg's and the distillation's server metrics."""
        metrics = super().aggregate(server_round, replies, inputs)
        if not replies or not self.settings.distils(server_round):
            return metrics
        teachers = [self._teacher(reply) for reply in replies]
        seed = round_seed(self.config.seed, SERVER, server_round, KD_SALT)
        self.global_tensors, statistics = self.distiller().distill(
            self.global_tensors, teachers, seed
        )
        log.info(
            "perada round %d: KD loss %.4f -> %.4f over %d clients",
            server_round,
            statistics["perada-kd-loss-first"],
            statistics["perada-kd-loss-last"],
            len(teachers),
        )
        return {**metrics, **statistics}

    def _teacher(self, reply: ClientReply) -> dict[str, torch.Tensor]:
        """A reply's tensors as a full model: the global tensors it did not send (none for a
        client that owns every part) at the new average."""
        return {n: reply.arrays.get(n, t) for n, t in self.global_tensors.items()}
