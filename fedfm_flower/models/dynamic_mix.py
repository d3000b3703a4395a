"""FedDPA's instance-wise dynamic weighting (sec. 4.3): each test instance gets its own mixture.

For a test instance x the client samples S of its local training instances x_1..x_S, embeds x
and each x_i with the global adapter alone, and mixes the adapters for x only with

    alpha_t = lambda * (1/S) * sum_i Sim(w_x, w_{x_i}),
    h' = W h + (1 - alpha_t) Delta_g h + alpha_t Delta_l h.

``InstanceWeightedLM`` wraps a dual-LoRA causal LM (``fedfm_flower.models.tuners.dual_lora``)
so that its ``forward`` and ``generate`` do this per batch row; the task's evaluation calls it
like any model.

Choices the paper leaves open, and ours:

* **Direction.** alpha_t weights the *local* adapter. The paper compares the input with the
  client's own training instances "to determine the appropriate weight balance", and its lambda
  (= alpha for FedDPA-T, 1 for FedDPA-F, A.2) only makes sense that way round: an instance like
  the local training data (similarity 1) gets exactly the mixture the local adapter was trained
  in, (1 - alpha, alpha) for T and the fine-tuned local adapter alone for F. The authors'
  released code is reported to weight the global adapter with alpha_t instead; with lambda =
  alpha = 0.3 that would give a perfectly local instance 0.3 of the global and 0.7 of the local
  adapter, a mixture it was never trained in. ``feddpa-direction = "global"`` gives that
  reading, for comparison; tests check both.
* **Representation.** The final layer's hidden states (``hidden_states[-1]``) of the prompt
  (the instruction template without the response), with the global adapter alone: the last
  prompt token (``last``, the paper's) or the mean over prompt tokens (``avg``, Table 10).
* **Scores in [0, 1]**, as the paper states. Cosine and Pearson (cosine of the centred vectors)
  lie in [-1, 1] and are clamped at 0. For the negative L2 distance (Table 9) the paper gives
  no normalisation; we use ``1 - |a - b| / (|a| + |b|)``, which lies in [0, 1] by the triangle
  inequality, is 1 exactly when a = b and falls as the distance grows.
* **Sampling.** S distinct instances per test instance (all of them when the client has fewer),
  drawn with a generator seeded by the evaluation's seed and the instance's prompt tokens: an
  instance gets the same sample in the loss pass and in generation, in whatever batch it is.
  Each sampled training instance is embedded once per evaluation (a cache), not once per test
  instance.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from fedfm_flower.models.language.encoding import IGNORE_INDEX
from fedfm_flower.models.tuners.dual_lora import GLOBAL, GLOBAL_ONLY, LOCAL, adapter_mix

DIRECTIONS: tuple[str, ...] = ("local", "global")


def representation(hidden: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """(batch, features) vectors of ``hidden`` (batch, tokens, features) over the tokens where
    ``mask`` is true: the last such token (``last``) or their mean (``avg``)."""
    mask = mask.bool()
    if not mask.any(dim=1).all():
        raise ValueError("every row needs at least one prompt token to represent it")
    if kind == "avg":
        weights = mask.to(hidden.dtype).unsqueeze(-1)
        return (hidden * weights).sum(1) / weights.sum(1)
    if kind == "last":
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask, positions, -1).max(dim=1).values
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"representation '{kind}' unknown; allowed: last, avg")


def similarity(query: torch.Tensor, keys: torch.Tensor, kind: str) -> torch.Tensor:
    """Scores in [0, 1] of ``query`` (batch, d) against ``keys`` (batch, S, d): (batch, S)."""
    a = query.unsqueeze(1).expand_as(keys)
    if kind == "cosine":
        return F.cosine_similarity(a, keys, dim=-1).clamp_min(0.0)
    if kind == "pearson":
        centred_a = a - a.mean(-1, keepdim=True)
        centred_k = keys - keys.mean(-1, keepdim=True)
        return F.cosine_similarity(centred_a, centred_k, dim=-1).clamp_min(0.0)
    if kind == "neg-l2":
        norms = a.norm(dim=-1) + keys.norm(dim=-1)
        distance = (a - keys).norm(dim=-1)
        return torch.where(norms > 0, 1.0 - distance / norms.clamp_min(1e-12), 1.0)
    raise ValueError(f"similarity '{kind}' unknown; allowed: cosine, neg-l2, pearson")


def prompt_mask(attention_mask: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """The prompt tokens of encoded rows: attended and, when labels are given, without a label."""
    mask = attention_mask.bool()
    return mask if labels is None else mask & (labels == IGNORE_INDEX)


class InstanceWeightedLM(nn.Module):
    """A dual-LoRA causal LM whose ``forward`` and ``generate`` mix its adapters per instance."""

    def __init__(
        self,
        model: nn.Module,
        pool: TensorDataset,
        *,
        instances: int,
        similarity: str,
        representation: str,
        scale: float,
        seed: int,
        batch_size: int = 32,
        direction: str = "local",
    ) -> None:
        super().__init__()
        if direction not in DIRECTIONS:
            raise ValueError(f"direction '{direction}' unknown; allowed: {', '.join(DIRECTIONS)}")
        if len(pool) == 0:
            raise ValueError("dynamic weighting needs the client's training instances; it has none")
        self.model = model
        self.pool = pool
        self.instances = instances
        self.similarity = similarity
        self.kind = representation
        self.scale = scale
        self.seed = seed
        self.batch_size = batch_size
        self.direction = direction
        self._cache: dict[int, torch.Tensor] = {}
        self.alphas: list[float] = []  # alpha_t of every row weighted so far

    @property
    def tokenizer(self) -> Any:
        """The wrapped model's tokenizer."""
        return self.model.tokenizer

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor):
        """Representations of the rows' ``mask`` tokens, with the global adapter alone."""
        # Positions from the mask, as generate() derives them: a left-padded prompt and the
        # same prompt right-padded in an encoded row get the same representation.
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad(), adapter_mix(self.model, GLOBAL_ONLY):
            out = self.model.lm(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions,
                output_hidden_states=True,
            )
        return representation(out.hidden_states[-1].float(), mask, self.kind)

    def sample(self, prompt_ids: torch.Tensor) -> list[int]:
        """The S training instances compared with the instance whose prompt is ``prompt_ids``."""
        digest = zlib.crc32(prompt_ids.detach().cpu().to(torch.int64).numpy().tobytes())
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + digest)
        order = torch.randperm(len(self.pool), generator=generator)
        return order[: self.instances].tolist()

    def pool_vectors(self, indices: list[int], device: torch.device) -> torch.Tensor:
        """(len(indices), d) representations of training instances (each embedded once)."""
        missing = sorted({i for i in indices if i not in self._cache})
        for start in range(0, len(missing), self.batch_size):
            chunk = missing[start : start + self.batch_size]
            input_ids, attention_mask, labels = (t[chunk] for t in self.pool.tensors)
            length = int(attention_mask.sum(1).max())
            rows = [t[:, :length].to(device) for t in (input_ids, attention_mask, labels)]
            vectors = self.embed(rows[0], rows[1], prompt_mask(rows[1], rows[2]))
            self._cache.update(zip(chunk, vectors, strict=True))
        return torch.stack([self._cache[i] for i in indices])

    def weights(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor | None
    ) -> torch.Tensor:
        """alpha_t of every row: lambda times its mean similarity to its S instances."""
        mask = prompt_mask(attention_mask, labels)
        query = self.embed(input_ids, attention_mask, mask)
        samples = [self.sample(row[keep]) for row, keep in zip(input_ids, mask, strict=True)]
        keys = torch.stack([self.pool_vectors(s, query.device) for s in samples])
        alpha = self.scale * similarity(query, keys, self.similarity).mean(dim=1)
        self.alphas.extend(alpha.tolist())
        return alpha

    def mixture(self, alpha: torch.Tensor) -> dict[str, torch.Tensor]:
        """Adapter weights of rows with ``alpha``: (1 - alpha, alpha), local or global first."""
        heavy, light = (LOCAL, GLOBAL) if self.direction == "local" else (GLOBAL, LOCAL)
        return {heavy: alpha, light: 1.0 - alpha}

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> Any:
        """The LM's output with every row's own mixture (alpha_t from its prompt tokens)."""
        alpha = self.weights(input_ids, attention_mask, labels)
        with adapter_mix(self.model, self.mixture(alpha)):
            return self.model(input_ids, attention_mask, labels)

    def generate(self, **kwargs: Any) -> torch.Tensor:
        """``generate`` with every prompt's own mixture, fixed for all its new tokens."""
        alpha = self.weights(kwargs["input_ids"], kwargs["attention_mask"], None)
        with adapter_mix(self.model, self.mixture(alpha)):
            return self.model.generate(**kwargs)
