"""Fused rounds: round t's evaluation carried on round t + 1's training messages.

``configure_round(t + 1, t, grid)`` puts ``evaluate-round`` = t in the config of the training
messages of the clients sampled for both: such a client evaluates, before it trains, the tensors
round t's evaluate message would have carried, and replies once. A client due the evaluation but
not sampled to train gets round t's evaluate message in the same phase. The replies are sorted
back into a training part per trainer and an evaluation part per evaluator (``FusedRound.sort``)
and validated apart: a bad training part does not drop the evaluation, nor the reverse.

This is exact only when round t's evaluation payload *is* round t + 1's training payload, as the
default ``evaluate_payload`` makes it; ``PersonalizedStrategy.fuses_evaluation()`` says whether a
strategy qualifies (the runner otherwise evaluates in a phase of its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flwr.app import Message

from fedfm_flower.records import protocol as P
from strategies.parts.outcome import RoundReport
from strategies.parts.replies import ReplyPart, evaluation_part, reply_part


@dataclass
class FusedRound:
    """A training phase in flight: its report, and the evaluation it carries (None: none)."""

    train: RoundReport
    evaluation: RoundReport | None = None
    carried: set[int] = field(default_factory=set)  # trainers whose message carries it

    def carry(
        self, messages: list[Message], evaluate_round: int, evaluated: list[int]
    ) -> list[int]:
        """Fuse ``evaluate_round``'s evaluation of ``evaluated`` into the training
        ``messages`` of those that train; the others, who need an evaluate message."""
        self.evaluation = RoundReport(sent=evaluated)
        wanted = set(evaluated)
        for message in messages:
            config = message.content.config_records[P.CONFIG]
            if int(config[P.CLIENT_ID]) in wanted:
                config[P.EVALUATE_ROUND] = evaluate_round
                self.carried.add(int(config[P.CLIENT_ID]))
        return [c for c in evaluated if c not in self.carried]

    def sort(
        self, replies: Iterable[Message], client_of: Mapping[int, int]
    ) -> tuple[list[ReplyPart], list[ReplyPart]]:
        """(training parts, evaluation parts) of the replies, each by its sender's message: a
        training reply (its evaluation part too, when its message carried one) or an evaluate
        reply."""
        training: list[ReplyPart] = []
        evaluation: list[ReplyPart] = []
        for reply in replies:
            client = client_of.get(reply.metadata.src_node_id)
            if self.evaluation is not None and client in self.evaluation.sent:
                if client not in self.train.sent:
                    evaluation.append(reply_part(reply))  # an evaluate-only reply
                    continue
                if client in self.carried:
                    evaluation.append(evaluation_part(reply))
            training.append(reply_part(reply))
        return training, evaluation
