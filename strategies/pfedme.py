"""pFedMe's server (Dinh et al. 2020, Algorithm 1): w^{t+1} = (1 - beta) w^t + beta * mean(w_i).

The mean of the clients' local models w_i is FedAvg's (``FedAvgStrategy.aggregate``: weighted
by training examples, in float64; DP-FedAvg's noised average or the SecAgg+ mean update when the
run asks for them); the beta step then moves w^t that far along the mean. beta = 1 leaves
FedAvg's result untouched (bit for bit). The step needs only w^t, which the server holds, and
the mean, so it is post-processing of the released average: a DP guarantee and SecAgg+'s
sum-only view are unchanged. The settings are in ``fedfm_flower.methods.pfedme``.
"""

from __future__ import annotations

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.pfedme import PFedMeSettings
from fedfm_flower.models import TrainableTensors
from strategies.fedavg import FedAvgStrategy
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.exchange import PLAIN_ROUND, RoundInputs
from strategies.parts.replies import ClientReply


def beta_step(
    previous: dict[str, torch.Tensor], mean: dict[str, torch.Tensor], beta: float
) -> dict[str, torch.Tensor]:
    """(1 - beta) previous + beta mean, tensor by tensor in float64, in the mean's dtype; the
    mean itself when beta = 1."""
    if beta == 1.0:
        return mean
    out = {}
    for name, avg in mean.items():
        prev = previous[name].to(torch.float64)
        out[name] = ((1.0 - beta) * prev + beta * avg.to(torch.float64)).to(avg.dtype)
    return out


class PFedMeStrategy(FedAvgStrategy):
    """FedAvg's mean of the clients' w_i, then the beta step from the previous global model."""

    def __init__(
        self, config: ExperimentConfig, initial: TrainableTensors, context: RunContext = NO_CONTEXT
    ) -> None:
        super().__init__(config, initial, context)
        self.beta = config.settings_of(PFedMeSettings).beta

    def aggregate(
        self, server_round: int, replies: list[ClientReply], inputs: RoundInputs = PLAIN_ROUND
    ) -> dict[str, float]:
        """The global tensors moved by beta along FedAvg's mean of the replies."""
        previous = self.global_tensors
        metrics = super().aggregate(server_round, replies, inputs)
        self.global_tensors = beta_step(previous, self.global_tensors, self.beta)
        return metrics
