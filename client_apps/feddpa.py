"""FedDPA's client (Yang et al. 2024): a global LoRA federated, a local one kept, mixed per input.

The model carries both adapters (tuner ``dual-lora``). Every federated round the client
trains the global adapter alone from the received one (eq. 2; with ``feddpa-prox-mu`` > 0,
FedProx's proximal term towards it, B.1) and sends it back. The local adapter never leaves
the client; it lives in the client state:

* **FedDPA-T** (Algorithm 2) trains it every round after the global one, with the global
  adapter frozen and mixed in as ``(1 - alpha) Delta_g + alpha Delta_l`` (sec. 4.2). The global
  adapter in that mixture is the one received this round: Algorithm 2's local step takes
  ``Delta theta_g`` (not the client's own ``Delta theta_g^m``), the adapter the client will
  evaluate with, and the authors' code restores the received weights before the local step.
* **FedDPA-F** (Algorithm 1) has none during the federated rounds; in the post-training round
  each client copies the final global adapter into the local one and fine-tunes it alone
  (``{theta, Delta theta_l}``) with the local schedule.

Evaluation mixes the received global adapter and the local one: per instance with alpha_t
(sec. 4.3, ``fedfm_flower.models.dynamic_mix``; lambda from ``feddpa-scale``) or with the fixed
``feddpa-alpha`` (``feddpa-weighting = fixed``). Before a client has a local adapter (FedDPA-F's
federated rounds) it evaluates the global adapter alone, i.e. FedIT.
"""

from __future__ import annotations

import statistics

import torch

from client_apps.base import ClientRuntime
from client_apps.split import SplitClient
from fedfm_flower.methods.feddpa import FedDPASettings
from fedfm_flower.models import TunedModel
from fedfm_flower.models.dynamic_mix import InstanceWeightedLM
from fedfm_flower.models.tuners.dual_lora import GLOBAL, GLOBAL_ONLY, LOCAL, adapter_mix
from fedfm_flower.tasks.training import EvalStats, TrainStats, proximal_term


def local_name(global_name: str) -> str:
    """The local adapter's twin of a global adapter parameter name."""
    twin = global_name.replace(f".{GLOBAL}.", f".{LOCAL}.")
    if twin == global_name:
        raise ValueError(f"'{global_name}' is not a parameter of the global adapter")
    return twin


class FedDPAClient(SplitClient):
    """FedDPA-T: global adapter trained and sent, local adapter trained alongside and kept."""

    trains_local_each_round = True

    def settings(self, runtime: ClientRuntime) -> FedDPASettings:
        """This run's ``feddpa-*`` settings."""
        return runtime.config.settings_of(FedDPASettings)

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Train the global adapter (eq. 2), send it; FedDPA-T then trains the local one."""
        settings = self.settings(runtime)
        model = self.prepare(runtime, received, {"before": server_round})
        global_names, local_names = self.split(runtime, model)
        penalty = None
        if settings.prox_mu > 0:
            penalty = proximal_term(
                model.parameters_named(global_names), received, settings.prox_mu
            )
        with adapter_mix(model, GLOBAL_ONLY):
            stats = runtime.train(model, global_names, runtime.seed(server_round), penalty=penalty)
        sent = model.tensors_named(global_names)
        if self.trains_local_each_round:
            model.load_tensors(received)
            mixture = {GLOBAL: 1.0 - settings.alpha, LOCAL: settings.alpha}
            with adapter_mix(model, mixture):
                stats = stats.then(
                    runtime.train(model, local_names, runtime.seed(server_round, salt=1))
                )
            runtime.store.save(server_round, model.tensors_named(local_names))
        return sent, stats

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """The received global adapter mixed with the latest local one (dynamic or fixed)."""

        settings = self.settings(runtime)
        model = self.prepare(runtime, received, {"at_most": server_round})
        if runtime.store.loaded_round == 0:  # no local adapter yet: FedIT's global adapter
            with adapter_mix(model, GLOBAL_ONLY):
                return runtime.evaluate(model)
        if settings.weighting == "fixed":
            with adapter_mix(model, {GLOBAL: 1.0 - settings.alpha, LOCAL: settings.alpha}):
                return runtime.evaluate(model)
        weighted = InstanceWeightedLM(
            model,
            runtime.data.train,
            instances=settings.instances,
            similarity=settings.similarity,
            representation=settings.representation,
            scale=settings.lambda_for(self.trains_local_each_round),
            seed=runtime.seed(server_round, salt=3),
            batch_size=runtime.config.batch_size,
            direction=settings.direction,
        )
        stats = runtime.evaluate(weighted)
        alpha = statistics.fmean(weighted.alphas) if weighted.alphas else 0.0
        return EvalStats(stats.loss, {**stats.metrics, "alpha": alpha}, stats.num_examples)


class FedDPAFineTuneClient(FedDPAClient):
    """FedDPA-F: the global adapter alone during FL; the local one fine-tuned after it."""

    trains_local_each_round = False

    def post_train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Local adapter := final global adapter, fine-tuned alone and kept (Algorithm 1)."""
        model: TunedModel = self.prepare(runtime, received, {"before": server_round})
        model.load_tensors({local_name(n): t for n, t in received.items()})
        local_names = self.split(runtime, model)[1]
        with adapter_mix(model, {GLOBAL: 0.0, LOCAL: 1.0}):
            stats = runtime.train(model, local_names, runtime.seed(server_round, salt=1))
        runtime.store.save(server_round, model.tensors_named(local_names))
        return {}, stats
