"""Prefixes in every self-attention layer of a timm ViT: FedPerfix (Sun et al., ICCV 2023).

FedPerfix's eq. 4 makes the prefixes from the layer input Z with a bottleneck adapter,
``P_k, P_v = Tanh(Z W_down) W_up``, scaled by ``s`` (eq. 5). Eq. 3/5 write the keys as
``Z [s P_k, W_k]``, a concatenation that the text does not pin down (``P_k`` is computed from
``Z`` and then multiplied by ``Z`` again). Two readings are implemented (``prefix-form``):

* ``parallel`` (default): the bracket is a concatenation along the feature axis of the input
  with the weights stacked, ``[Z, s Tanh(Z W_down)] [W_k; W_up,k]``, i.e. per token
  ``k = Z W_k + s P_k(Z)`` and ``v = Z W_v + s P_v(Z)``. This is the parallel-attention form of
  Yu et al. (2022) that the paper cites for its design, and what the authors' released code
  computes (``qkv(x) + s * [0, up(tanh(down(x)))]``): the prefixes enter the keys and values of
  every head, the queries are untouched, the sequence keeps its length.
* ``concat``: the bracket is a concatenation along the sequence axis (prefix-tuning as Li &
  Liang 2021 and He et al. 2022 write it): the N prefix tokens ``s P_k(Z)``, ``s P_v(Z)`` are
  appended to the N keys and values. Only under this reading does the paper's eq. 6 hold
  exactly: per query token and head the output is ``(1 - lambda) Attn(q, K, V) +
  lambda Attn(q, sP_k, sP_v)``, with ``lambda`` the softmax mass on the prefix keys
  (``tests/test_fedperfix.py`` checks both forms against hand-written attention).

The bottleneck width (``prefix-bottleneck``, 256) and ``s`` (``prefix-scale``, 1.5) default to
the authors' released ViT-S configuration (their argparse default of 0.8 for ``s`` is
overridden by the FedPerfix preset); the paper itself states neither. The adapter's linear
layers keep PyTorch's default initialisation, as in the released code, so the prefixes are
non-zero from the start.

Vanilla prefix-tuning (the paper's Prefix-Z and Prefix-R, its Table 6) replaces the adapter by
one linear map ``Z -> [P_k, P_v]`` initialised with zeros (``prefix-zero``) or randomly
(``prefix-random``), as in the authors' code; the form is chosen the same way. Parameters live
in ``<block>.attn.prefix.*``: group ``prefix``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.groups import GroupPattern
from fedfm_flower.models.tuners import TunedParts
from fedfm_flower.models.tuners.keys import PREFIX_FORMS

PREFIX_PATTERNS = (GroupPattern("prefix", r"\.attn\.prefix\."),)


class PrefixAdapter(nn.Module):
    """Eq. 4: ``[P_k, P_v] = Tanh(Z W_down) W_up`` per token, 2 x attention width out."""

    def __init__(self, width: int, attn_dim: int, bottleneck: int) -> None:
        super().__init__()
        self.down = nn.Linear(width, bottleneck)
        self.up = nn.Linear(bottleneck, 2 * attn_dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """The key and value prefixes of each token, concatenated on the last axis."""
        return self.up(torch.tanh(self.down(z)))


class LinearPrefix(nn.Module):
    """Vanilla prefixes ``[P_k, P_v] = Z W`` (Prefix-Z: W = 0 at start; Prefix-R: random)."""

    def __init__(self, width: int, attn_dim: int, zero: bool) -> None:
        super().__init__()
        self.kv = nn.Linear(width, 2 * attn_dim)
        if zero:
            nn.init.zeros_(self.kv.weight)
            nn.init.zeros_(self.kv.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """The key and value prefixes of each token, concatenated on the last axis."""
        return self.kv(z)


class PrefixedAttention(nn.Module):
    """A timm ``Attention`` whose keys and values take prefixes (its own modules, adopted).

    The original ``qkv``, ``proj`` and norms are kept under their names, so the ViT's weights
    keep their parameter names (``blocks.3.attn.qkv.weight``).
    """

    def __init__(self, attention: nn.Module, prefix: nn.Module, scale: float, form: str) -> None:
        super().__init__()
        if getattr(attention, "gate", None) is not None:
            raise ValueError("prefixes do not support gated timm attention")
        if form not in PREFIX_FORMS:
            raise ValueError(f"prefix form '{form}' unknown; allowed: {', '.join(PREFIX_FORMS)}")
        self.num_heads = attention.num_heads
        self.head_dim = attention.head_dim
        self.attn_dim = attention.attn_dim
        for name in ("qkv", "q_norm", "k_norm", "attn_drop", "norm", "proj", "proj_drop"):
            setattr(self, name, getattr(attention, name))
        self.prefix = prefix
        self.scale = scale
        self.form = form

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        return x.reshape(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """Self-attention with the prefixes in the keys and values of every head."""
        if attn_mask is not None or is_causal:
            raise ValueError("prefixed attention takes no attention mask")
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(x).split(self.attn_dim, dim=-1)
        p_k, p_v = (self.scale * self.prefix(x)).split(self.attn_dim, dim=-1)
        if self.form == "parallel":
            k, v = k + p_k, v + p_v
        else:
            k, v = torch.cat([p_k, k], dim=1), torch.cat([p_v, v], dim=1)
        q, k, v = self.q_norm(self._heads(q)), self.k_norm(self._heads(k)), self._heads(v)
        dropout = self.attn_drop.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        out = out.transpose(1, 2).reshape(batch, tokens, self.attn_dim)
        return self.proj_drop(self.proj(self.norm(out)))


def add_prefixes(backbone: nn.Module, make_prefix, scale: float, form: str) -> nn.Module:  # noqa: ANN001 - (width, attn_dim) -> nn.Module
    """Replace every block's attention of a timm ViT by a PrefixedAttention; returns it."""
    for block in backbone.blocks:
        attention = block.attn
        prefix = make_prefix(backbone.embed_dim, attention.attn_dim)
        block.attn = PrefixedAttention(attention, prefix, scale, form)
    return backbone


def perfix_tuner(backbone: nn.Module, config: ExperimentConfig) -> TunedParts:
    """FedPerfix's adapter-made prefixes (eq. 4-5) in every block (group ``prefix``)."""
    bottleneck = config.prefix_bottleneck

    def make(width: int, attn_dim: int) -> nn.Module:
        return PrefixAdapter(width, attn_dim, bottleneck)

    backbone = add_prefixes(backbone, make, config.prefix_scale, config.prefix_form)
    return TunedParts(backbone, {}, PREFIX_PATTERNS)


def _linear_prefix_tuner(zero: bool):  # noqa: ANN202 - a Tuner
    def tuner(backbone: nn.Module, config: ExperimentConfig) -> TunedParts:
        def make(width: int, attn_dim: int) -> nn.Module:
            return LinearPrefix(width, attn_dim, zero)

        backbone = add_prefixes(backbone, make, config.prefix_scale, config.prefix_form)
        return TunedParts(backbone, {}, PREFIX_PATTERNS)

    tuner.__doc__ = f"Vanilla prefixes, {'zero' if zero else 'random'}-initialised (``prefix``)."
    return tuner


prefix_zero_tuner = _linear_prefix_tuner(zero=True)
prefix_random_tuner = _linear_prefix_tuner(zero=False)
