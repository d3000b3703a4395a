"""TAP's post-FL knowledge distillation (sec. 3.3, eq. 5-6) on the multi-task task's outputs.

eq. 5 is the KL divergence of the student's temperature-softened distribution from the
teacher's, ``sum_j p_t,j (log p_t,j - log p_s,j)`` with ``p = softmax(z / tau)``; the paper
writes no ``tau^2`` factor and neither do we. Per pair kind:

* classification: eq. 5 over the classes, averaged over the pair's examples;
* text generation (and VQA): eq. 5 over the vocabulary at every scored target position (the
  same positions the task loss scores), averaged over those tokens: the KD target per token;
* image generation has no logits: the student's images are pulled to the teacher's by their
  mean squared difference per pixel (our choice; the paper states eq. 5 for logits only).

``DistillationTask`` wraps the multi-task task so that the shared training loop trains X with
eq. 6: ``sum_o lambda_o loss_o + sum_o beta_o KD_o`` over the pairs o in the batch, the teacher
W~ frozen.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from fedfm_flower.data.multitask import CLASSIFICATION, IMAGE_GENERATION, PAIRS
from fedfm_flower.tasks.base import Batch, StepResult, Task, TrainingObjective
from fedfm_flower.tasks.multitask import TaskOutput, task_outputs, weighted_loss


def softened_kl(teacher: torch.Tensor, student: torch.Tensor, temperature: float) -> torch.Tensor:
    """eq. 5 for rows of logits (..., K): mean over rows of KL(p_teacher || p_student)."""
    log_t = F.log_softmax(teacher / temperature, dim=-1)
    log_s = F.log_softmax(student / temperature, dim=-1)
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean()


def distillation_loss(student: TaskOutput, teacher: TaskOutput, temperature: float) -> torch.Tensor:
    """The KD term of one pair (module docstring): classes, scored tokens, or pixels."""
    kind = PAIRS[student.task].kind
    if kind == CLASSIFICATION:
        return softened_kl(teacher.outputs, student.outputs, temperature)
    if kind == IMAGE_GENERATION:
        return F.mse_loss(student.outputs, teacher.outputs)
    scored = student.token_mask
    if scored is None or not scored.any():
        return student.outputs.sum() * 0.0
    return softened_kl(teacher.outputs[scored], student.outputs[scored], temperature)


class DistillationTask(TrainingObjective):
    """The multi-task task whose training loss is eq. 6 against a frozen teacher."""

    def __init__(
        self, task: Task, teacher: nn.Module, weights: Mapping[str, float], temperature: float
    ) -> None:
        super().__init__(task)
        self.teacher = teacher.eval()
        self.weights = dict(weights)  # beta_o by pair
        self.temperature = temperature

    def step(self, model: nn.Module, batch: Batch) -> StepResult:
        """eq. 6: the lambda-weighted task losses plus beta_o times each pair's KD term."""
        outputs = task_outputs(model, batch)
        with torch.no_grad():
            targets = task_outputs(self.teacher, batch)
        loss = weighted_loss(outputs, len(batch[0]))
        sums: dict[str, float] = {}
        for task, out in outputs.items():
            kd = distillation_loss(out, targets[task], self.temperature)
            loss = loss + self.weights.get(task, 0.0) * kd
            sums[f"loss-{task}"] = out.loss.item() * out.count
            sums[f"count-{task}"] = float(out.count)
            sums[f"distill-{task}"] = kd.item() * out.count
        return StepResult(loss, len(batch[0]), sums)
