"""TAP's multi-modal multi-task model (sec. 3.1, A.2, D.1), built from the offline foundations.

Backbones: ``mm-offline`` (below) and ``mm-flava`` / ``mm-vilt``, the paper's own, built from
a FLAVA or ViLT checkpoint (``fedfm_flower.models.multimodal_hf``: same components, groups and
decoders). Layout of ``mm-offline`` (the server model; a client uses the components its
modality-task pairs need):

* **Encoders** (frozen, LoRA-tuned): ``image`` = the offline ViT's patch embedding, class token,
  position embedding and first block, fed the pair's [0, 1] images mapped to [-1, 1]
  (``data.images.normalize``), the range the ViT was pretrained on; ``text`` = the offline
  tiny LLaMA's token embedding and first decoder layer (a linear projection, trained, when its
  width differs from the ViT's).
* **Backbone**, two stacks built from the next two ViT blocks (the paper loads FLAVA's first two
  multimodal layers): the *modality* stack has one layer per modality plus a shared one; a
  modality layer's FFN is a mixture of task experts (the input's task picks its expert). The
  *task* stack has one layer per task plus a shared one; a task layer's FFN is a mixture of
  modality experts (each token goes to the expert of its modality). Every expert is a copy of
  the pretrained FFN (Wu et al. 2022), frozen, with LoRA on ``fc1``/``fc2``; attention is
  frozen with LoRA on ``qkv``. A token's output of a stack is the mean of its specific layer's
  and the shared layer's outputs (A.2 says both are active; how they combine is ours). With
  more than two pretrained blocks (ViLT's eight), the first half makes every layer of the
  modality stack and the second half every layer of the task stack (``ExpertStack``; a token
  keeps its expert through the blocks).
* **Standard backbone** (``routing = "shared"``, run-config key ``mm-backbone-routing``; TAP's
  App. C.4 baselines): no modality or task layers, no experts: each modality's tokens go through
  the modality stack's shared layer alone, the joined tokens through the task stack's shared
  layer alone (a token's output of a stack is the shared layer's), so every pair uses the same
  backbone components (``mome.shared``, ``mote.shared``) and component-wise FedAvg of the
  backbone is vanilla FedAvg.
* **Decoders** (trained fully, D.1): per classification task an MLP head (FLAVA's Table 18:
  2 layers, ReLU, hidden d/2, dropout 0.3); one transposed-convolution image head shared by the
  image-generation tasks (Table 19, scaled to the image size: a linear map to 64 x S/8 x S/8,
  then 64 -> 32 -> 16 -> 3 channels, kernel 4, stride 2; a sigmoid, ours, for pixels in
  [0, 1]); one GPT-2-style text head shared by the text-generation tasks (Table 20: token and
  position embeddings, one block with causal self-attention (4 heads), cross-attention to the
  backbone's tokens (8 heads) and an FFN of twice the width, an unbiased output projection).
  Classification and image heads read the masked mean of the backbone's tokens.

Parameter groups (component names, open and dotted): ``encoder.image``, ``encoder.text``,
``mome.<modality>.attn``, ``mome.<modality>.expert.<task>``, ``mome.shared``,
``mote.<task>.attn``, ``mote.<task>.expert.<modality>``, ``mote.shared``, ``decoder.<task>``
(classification), ``decoder.image-generation``, ``decoder.text-generation``.
``components_for(tasks)`` lists the groups a holder of ``tasks`` owns. With
``routing = "shared"`` the ``mome.<modality>...`` and ``mote.<task>...`` groups do not exist.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedfm_flower.config.keys import MM_BACKBONE_ROUTINGS
from fedfm_flower.data.images import normalize
from fedfm_flower.data.multitask import (
    CLASSIFICATION,
    IMAGE_GENERATION,
    PAIRS,
    TEXT_GENERATION,
    PairSpec,
)
from fedfm_flower.models.causal_lm import foundation_args, prepare_tiny_llama, tokenizer_of
from fedfm_flower.models.classifier import vision_backbone
from fedfm_flower.models.foundation import prepare_offline_backbone
from fedfm_flower.models.foundation_cards import composite
from fedfm_flower.models.groups import GroupPattern, TunedModel
from fedfm_flower.models.language import foundation


class LoRABranch(nn.Module):
    """A second low-rank update of a ``LoRALayer`` (FedDAT's client-specific adapter) and the
    weights that mix it with the layer's own: ``main_weight * B A x + weight * B' A' x``."""

    def __init__(self, like: nn.Module, weight: float, main_weight: float) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(like.lora_a.detach().clone())
        self.lora_b = nn.Parameter(like.lora_b.detach().clone())
        self.weight = weight
        self.main_weight = main_weight


class LoRALayer(nn.Module):
    """A frozen layer ``base`` plus a trainable low-rank update, ``base(x) + scale * U(x; B, A)``;
    a subclass says how its input is prepared (``lora_input``: dropout, or none) and what the
    update of factors (A, B) is (``low_rank``).

    With a ``branch`` (``add_branch``; none by default, and then the forward is the plain one)
    the update is ``scale * (w_main U(x; B, A) + w U(x; B', A'))`` on the same prepared input
    (FedDAT's dual-adapter teacher)."""

    base: nn.Module
    lora_a: nn.Parameter
    lora_b: nn.Parameter
    scale: float

    def __init__(self) -> None:
        super().__init__()
        self.branch: LoRABranch | None = None

    def add_branch(self, weight: float, main_weight: float) -> LoRABranch:
        """Give the layer a second low-rank update, a copy of its own factors, mixed as
        ``main_weight * B A + weight * B' A'``; returns it."""
        self.branch = LoRABranch(self, weight, main_weight)
        return self.branch

    def lora_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input the low-rank updates read (the layer's own input by default)."""
        return x

    def low_rank(self, h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The update of factors ``a`` (A) and ``b`` (B) on the prepared input ``h``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """base(x) + scale * the update (with a branch: the mixture of the two updates)."""
        h = self.lora_input(x)
        own = self.low_rank(h, self.lora_a, self.lora_b)
        if self.branch is None:
            return self.base(x) + self.scale * own
        other = self.low_rank(h, self.branch.lora_a, self.branch.lora_b)
        return self.base(x) + self.scale * (
            self.branch.main_weight * own + self.branch.weight * other
        )


class LoRALinear(LoRALayer):
    """A frozen linear layer plus a trainable low-rank update: W x + (alpha / r) B A dropout(x)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))  # starts as identity
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # peft's default for A
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)

    @property
    def in_features(self) -> int:
        """The base layer's input width."""
        return self.base.in_features

    @property
    def out_features(self) -> int:
        """The base layer's output width."""
        return self.base.out_features

    def lora_input(self, x: torch.Tensor) -> torch.Tensor:
        """dropout(x)."""
        return self.dropout(x)

    def low_rank(self, h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """B A h."""
        return F.linear(F.linear(h, a), b)


def _with_lora(module: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
    return LoRALinear(module, rank, alpha, dropout)


class ExpertBlock(nn.Module):
    """A pretrained ViT block whose FFN is a mixture of named experts (copies of the FFN).

    ``block`` is a timm ViT block, or anything with its attributes (``norm1``, ``attn``,
    ``norm2``, ``mlp`` with ``fc1``/``fc2``, ``ls1``, ``ls2``; ``multimodal_hf.HFBlock`` adapts
    a FLAVA or ViLT layer). LoRA goes on the attention's ``lora_targets`` (timm's: ``qkv``).
    """

    def __init__(
        self, block: nn.Module, experts: Sequence[str], rank: int, alpha: float, dropout: float
    ) -> None:
        super().__init__()
        block = copy.deepcopy(block)
        for p in block.parameters():
            p.requires_grad_(False)
        self.norm1, self.attn, self.norm2 = block.norm1, block.attn, block.norm2
        for target in getattr(self.attn, "lora_targets", ("qkv",)):
            tuned = _with_lora(getattr(self.attn, target), rank, alpha, dropout)
            setattr(self.attn, target, tuned)
        self.ls1, self.ls2 = block.ls1, block.ls2
        self.experts = nn.ModuleDict()
        for name in experts:
            mlp = copy.deepcopy(block.mlp)
            mlp.fc1 = _with_lora(mlp.fc1, rank, alpha, dropout)
            mlp.fc2 = _with_lora(mlp.fc2, rank, alpha, dropout)
            self.experts[name] = mlp

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, route: Sequence[str] | str
    ) -> torch.Tensor:
        """Block output; ``route`` names the expert of every token (a str: of all of them)."""
        attend = mask[:, None, None, :].bool()  # (B, 1, 1, N): keys a token may attend to
        x = x + self.ls1(self.attn(self.norm1(x), attn_mask=attend))
        h = self.norm2(x)
        if isinstance(route, str):
            return x + self.ls2(self.experts[route](h))
        out = torch.zeros_like(h)
        for name in dict.fromkeys(route):
            rows = torch.tensor([r == name for r in route], device=h.device)
            out[:, rows] = self.experts[name](h[:, rows])
        return x + self.ls2(out)


class ExpertStack(nn.ModuleList):
    """Consecutive ExpertBlocks with the same experts: one layer of a backbone stack built from
    several pretrained blocks (ViLT's four per stack); a token keeps its expert throughout."""

    @property
    def experts(self) -> nn.ModuleDict:
        """The first block's experts (every block has the same names)."""
        return self[0].experts

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, route: Sequence[str] | str
    ) -> torch.Tensor:
        """The blocks' output, one after the other, with the same ``route``."""
        for block in self:
            x = block(x, mask, route)
        return x


class ClassificationHead(nn.Module):
    """FLAVA's MLP head (Table 18): Linear(d, d/2), ReLU, Dropout(0.3), Linear(d/2, C)."""

    def __init__(self, width: int, num_classes: int, dropout: float = 0.3) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(width, width // 2),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(width // 2, num_classes),
        )

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Class logits of the pooled features."""
        return self.layers(pooled)


class ImageGenerationHead(nn.Module):
    """Table 19's transposed-convolution decoder, scaled to ``image_size`` (a multiple of 8)."""

    def __init__(self, width: int, image_size: int) -> None:
        super().__init__()
        if image_size % 8:
            raise ValueError(
                f"image generation needs an image size divisible by 8, not {image_size}"
            )
        self.side = image_size // 8
        self.project = nn.Linear(width, 64 * self.side * self.side)
        self.layers = nn.Sequential(
            nn.ConvTranspose2d(64, 32, 4, 2, 1),
            nn.ReLU(),
            nn.ConvTranspose2d(32, 16, 4, 2, 1),
            nn.ReLU(),
            nn.ConvTranspose2d(16, 3, 4, 2, 1),
        )

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, S, S) in [0, 1]."""
        grid = self.project(pooled).view(-1, 64, self.side, self.side)
        return torch.sigmoid(self.layers(grid))


class TextGenerationHead(nn.Module):
    """Table 20's conditional GPT-2-style decoder: one block, cross-attending the backbone."""

    def __init__(self, width: int, vocab_size: int, max_length: int = 128) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(max_length, width)
        self.norm_self, self.norm_cross, self.norm_ffn, self.norm_out = (
            nn.LayerNorm(width) for _ in range(4)
        )
        self.self_attention = nn.MultiheadAttention(width, 4, batch_first=True)
        self.cross_attention = nn.MultiheadAttention(width, 8, batch_first=True)
        self.ffn = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.output = nn.Linear(width, vocab_size, bias=False)
        self.max_length = max_length

    def forward(
        self, ids: torch.Tensor, memory: torch.Tensor, memory_mask: torch.Tensor
    ) -> torch.Tensor:
        """Next-token logits (B, U, V) of ``ids`` (B, U) given the backbone's tokens."""
        length = ids.shape[1]
        if length > self.max_length:
            raise ValueError(f"text head takes at most {self.max_length} tokens, got {length}")
        positions = torch.arange(length, device=ids.device)
        h = self.tokens(ids) + self.positions(positions)
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=ids.device), 1)
        q = self.norm_self(h)
        h = h + self.self_attention(q, q, q, attn_mask=causal, need_weights=False)[0]
        q = self.norm_cross(h)
        ignore = ~memory_mask.bool()
        h = (
            h
            + self.cross_attention(q, memory, memory, key_padding_mask=ignore, need_weights=False)[
                0
            ]
        )
        h = h + self.ffn(self.norm_ffn(h))
        return self.output(self.norm_out(h))


def _pool(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.to(tokens.dtype).unsqueeze(-1)
    return (tokens * weights).sum(1) / weights.sum(1).clamp_min(1.0)


class MultiModalMultiTask(TunedModel):
    """Encoders, the MoME/MoTE backbone and the task decoders of TAP's server model."""

    def __init__(
        self,
        image_encoder: nn.Module,
        text_encoder: nn.Module,
        text_width: int,
        blocks: Sequence[nn.Module],
        final_norm: nn.Module,
        pairs: Mapping[str, PairSpec],
        tokenizer: Any,
        *,
        rank: int,
        alpha: float,
        dropout: float,
        image_size: int,
        max_target_length: int = 128,
        routing: str = "experts",
    ) -> None:
        super().__init__()
        if routing not in MM_BACKBONE_ROUTINGS:
            raise ValueError(f"routing must be one of {MM_BACKBONE_ROUTINGS}, not {routing!r}")
        if not blocks or len(blocks) % 2:
            raise ValueError(
                "the backbone takes an even number of pretrained blocks (the first half for the "
                f"modality stack, the second for the task stack), got {len(blocks)}"
            )
        depth = len(blocks) // 2

        def layer(pretrained: Sequence[nn.Module], experts: Sequence[str]) -> nn.Module:
            made = [ExpertBlock(b, experts, rank, alpha, dropout) for b in pretrained]
            return made[0] if depth == 1 else ExpertStack(made)

        self.pairs = dict(pairs)
        self.tokenizer = tokenizer
        self.routing = routing
        experts = routing == "experts"  # else the standard backbone: the shared layers only
        width = blocks[0].norm1.normalized_shape[0]
        self.width = width
        self.image_encoder = image_encoder
        self.text_encoder = text_encoder
        self.text_projection = nn.Linear(text_width, width) if text_width != width else None
        modalities = sorted({m for spec in self.pairs.values() for m in spec.modalities})
        modality_blocks, task_blocks = blocks[:depth], blocks[depth:]
        self.mome = nn.ModuleDict(
            {
                m: layer(modality_blocks, [t for t, s in self.pairs.items() if m in s.modalities])
                for m in (modalities if experts else ())
            }
        )
        self.mome_shared = layer(modality_blocks, ["shared"])
        self.mote = nn.ModuleDict(
            {t: layer(task_blocks, list(s.modalities)) for t, s in self.pairs.items() if experts}
        )
        self.mote_shared = layer(task_blocks, ["shared"])
        self.final_norm = copy.deepcopy(final_norm).requires_grad_(False)
        self.decoders = nn.ModuleDict()
        for task, spec in self.pairs.items():
            if spec.kind == CLASSIFICATION:
                self.decoders[task] = ClassificationHead(width, spec.num_classes)
        kinds = {s.kind for s in self.pairs.values()}
        if IMAGE_GENERATION in kinds:
            self.decoders[IMAGE_GENERATION] = ImageGenerationHead(width, image_size)
        if TEXT_GENERATION in kinds:
            self.decoders[TEXT_GENERATION] = TextGenerationHead(
                width, len(tokenizer), max_target_length
            )
        self.group_patterns = self._patterns()

    # ----------------------------------------------------------------- components
    @classmethod
    def for_run(
        cls,
        config: Any,
        image_encoder: nn.Module,
        text_encoder: nn.Module,
        text_width: int,
        blocks: Sequence[nn.Module],
        final_norm: nn.Module,
        tokenizer: Any,
    ) -> MultiModalMultiTask:
        """The model with every pair of the multi-task data, LoRA and sizes from the run config."""

        return cls(
            image_encoder,
            text_encoder,
            text_width,
            blocks,
            final_norm,
            PAIRS,
            tokenizer,
            rank=config.lora_rank,
            alpha=config.lora_alpha,
            dropout=config.lora_dropout,
            image_size=config.image_size,
            max_target_length=config.max_length,
            routing=config.mm_backbone_routing,
        )

    def _patterns(self) -> tuple[GroupPattern, ...]:
        lora = r"\.lora_[ab]$"
        block = r"(?:\d+\.)?"  # an ExpertStack's block index (none for one block per stack)
        patterns = [
            GroupPattern("encoder.image", r"^image_encoder\..*" + lora),
            GroupPattern("encoder.text", r"^text_encoder\..*" + lora),
            GroupPattern("encoder.text", r"^text_projection\."),
            GroupPattern("mome.shared", r"^mome_shared\..*" + lora),
            GroupPattern("mote.shared", r"^mote_shared\..*" + lora),
        ]
        for m, layer in self.mome.items():
            prefix = rf"^mome\.{m}\.{block}"
            patterns.append(GroupPattern(f"mome.{m}.attn", prefix + r"attn\..*" + lora))
            for task in layer.experts:
                expert = prefix + rf"experts\.{re.escape(task)}\."
                patterns.append(GroupPattern(f"mome.{m}.expert.{task}", expert + ".*" + lora))
        for task, layer in self.mote.items():
            prefix = rf"^mote\.{re.escape(task)}\.{block}"
            patterns.append(GroupPattern(f"mote.{task}.attn", prefix + r"attn\..*" + lora))
            for m in layer.experts:
                group = f"mote.{task}.expert.{m}"
                patterns.append(GroupPattern(group, prefix + rf"experts\.{m}\..*" + lora))
        for name in self.decoders:
            patterns.append(GroupPattern(f"decoder.{name}", rf"^decoders\.{re.escape(name)}\."))
        return tuple(patterns)

    def group_users(self) -> dict[str, frozenset[str]]:
        """Component -> the modality-task pairs that use it (the shared layers: all of them)."""
        every = frozenset(self.pairs)
        users: dict[str, set[str]] = {"mome.shared": set(every), "mote.shared": set(every)}
        for task, spec in self.pairs.items():
            for m in spec.modalities:  # (no mome.<m>/mote.<task> groups with shared routing)
                for group in (f"encoder.{m}", f"mome.{m}.attn", f"mome.{m}.expert.{task}"):
                    users.setdefault(group, set()).add(task)
                users.setdefault(f"mote.{task}.expert.{m}", set()).add(task)
            users.setdefault(f"mote.{task}.attn", set()).add(task)
            users.setdefault(f"decoder.{self.decoder_of(task)}", set()).add(task)
        present = set(self.parameter_groups().values())
        return {g: frozenset(u) for g, u in users.items() if g in present}

    def components_for(self, tasks: Iterable[str]) -> tuple[str, ...]:
        """The components a holder of ``tasks`` owns (its encoders, layers, experts, decoders
        and the shared layers), in model order."""
        tasks = set(tasks)
        unknown = sorted(tasks - set(self.pairs))
        if unknown:
            raise ValueError(f"tasks {unknown} are not in this model: {sorted(self.pairs)}")
        users = self.group_users()
        groups = dict.fromkeys(self.parameter_groups().values())
        return tuple(g for g in groups if users[g] & tasks)

    def decoder_of(self, task: str) -> str:
        """The decoder a task uses: its own head, or the head shared by its kind."""
        kind = self.pairs[task].kind
        return task if kind == CLASSIFICATION else kind

    @property
    def task_names(self) -> tuple[str, ...]:
        """The modality-task pairs this model serves."""
        return tuple(self.pairs)

    # ----------------------------------------------------------------- forward
    def encode(
        self,
        task: str,
        images: torch.Tensor | None,
        text_ids: torch.Tensor | None,
        text_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The backbone's tokens (B, N, d) and their mask (B, N) for ``task``'s inputs."""
        spec = self.pairs[task]
        streams: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        if "image" in spec.modalities:
            if images is None:
                raise ValueError(f"task '{task}' needs images")
            tokens = self.image_encoder(images)
            streams.append(("image", tokens, tokens.new_ones(tokens.shape[:2])))
        if "text" in spec.modalities:
            if text_ids is None or text_mask is None:
                raise ValueError(f"task '{task}' needs text")
            tokens = self.text_encoder(text_ids, text_mask)
            if self.text_projection is not None:
                tokens = self.text_projection(tokens)
            streams.append(("text", tokens, text_mask.to(tokens.dtype)))
        outs, masks, route = [], [], []
        for modality, tokens, mask in streams:
            specific = self.mome[modality](tokens, mask, task) if self.mome else None
            shared = self.mome_shared(tokens, mask, "shared")
            outs.append(shared if specific is None else 0.5 * (specific + shared))
            masks.append(mask)
            route += [modality] * tokens.shape[1]
        x, mask = torch.cat(outs, 1), torch.cat(masks, 1)
        specific = self.mote[task](x, mask, route) if self.mote else None
        shared = self.mote_shared(x, mask, "shared")
        return self.final_norm(shared if specific is None else 0.5 * (specific + shared)), mask

    def forward(
        self,
        task: str,
        images: torch.Tensor | None,
        text_ids: torch.Tensor | None,
        text_mask: torch.Tensor | None,
        target_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Class logits, generated images, or next-token logits of ``target_ids``."""
        tokens, mask = self.encode(task, images, text_ids, text_mask)
        kind = self.pairs[task].kind
        decoder = self.decoders[self.decoder_of(task)]
        if kind == TEXT_GENERATION:
            if target_ids is None:
                raise ValueError(f"text-generation task '{task}' needs target_ids")
            return decoder(target_ids, tokens, mask)
        return decoder(_pool(tokens, mask))

    @torch.no_grad()
    def generate(
        self,
        task: str,
        images: torch.Tensor | None,
        text_ids: torch.Tensor | None,
        text_mask: torch.Tensor | None,
        max_new_tokens: int,
    ) -> torch.Tensor:
        """Greedy new token ids (B, <= max_new_tokens); a row ends at EOS (then padding)."""
        if self.pairs[task].kind != TEXT_GENERATION:
            raise ValueError(f"task '{task}' does not generate text")
        tokens, mask = self.encode(task, images, text_ids, text_mask)
        head = self.decoders[TEXT_GENERATION]
        batch = tokens.shape[0]
        bos, eos, pad = (
            self.tokenizer.bos_token_id,
            self.tokenizer.eos_token_id,
            self.tokenizer.pad_token_id,
        )
        ids = torch.full((batch, 1), bos, dtype=torch.long, device=tokens.device)
        done = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
        for _ in range(min(max_new_tokens, head.max_length - 1)):
            nxt = head(ids, tokens, mask)[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            ids = torch.cat([ids, nxt[:, None]], 1)
            done |= nxt == eos
            if done.all():
                break
        return ids[:, 1:]


class ImageEncoder(nn.Module):
    """The offline ViT's patch embedding, class token, positions and first block (LoRA on qkv)."""

    def __init__(self, vit: nn.Module, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        vit = copy.deepcopy(vit)
        for p in vit.parameters():
            p.requires_grad_(False)
        self.patch_embed, self.cls_token, self.pos_embed = (
            vit.patch_embed,
            vit.cls_token,
            vit.pos_embed,
        )
        self.block = vit.blocks[0]
        self.block.attn.qkv = _with_lora(self.block.attn.qkv, rank, alpha, dropout)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 1 + patches, d) tokens of [0, 1] images, normalised as in pretraining."""
        x = self.patch_embed(normalize(images))
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.block(x)


class TextEncoder(nn.Module):
    """The tiny LLaMA's token embedding and first decoder layer (LoRA on q_proj and v_proj)."""

    def __init__(self, lm: nn.Module, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        body = copy.deepcopy(lm.model)
        for p in body.parameters():
            p.requires_grad_(False)
        body.layers = body.layers[:1]
        body.config.num_hidden_layers = 1
        attention = body.layers[0].self_attn
        attention.q_proj = _with_lora(attention.q_proj, rank, alpha, dropout)
        attention.v_proj = _with_lora(attention.v_proj, rank, alpha, dropout)
        self.body = body

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, width) hidden states after the first layer (and the LLaMA's final norm)."""
        return self.body(input_ids=ids, attention_mask=mask).last_hidden_state


def text_foundation_config(config: Any) -> Any:
    """The run config of the tiny LLaMA this model's text parts come from (any method: the
    foundation does not depend on it)."""
    return config.replace(
        method="fedavg",
        dataset="instructions",
        backbone="tiny-llama",
        multitask_style_skew=False,
        mm_backbone_routing="experts",
    )


def image_foundation_config(config: Any) -> Any:
    """The run config of the small-vit this model's image parts come from."""
    return config.replace(
        method="fedavg",
        dataset="glyph-domains",
        backbone="small-vit",
        multitask_style_skew=False,
        mm_backbone_routing="experts",
    )


def prepare_mm_offline(config: Any) -> dict[str, Any]:
    """The multimodal family's foundation hook: the two offline foundations ``mm-offline`` is
    built from (built if missing), as one composite card (``foundation_cards.composite``)."""

    return composite(
        {
            "image": prepare_offline_backbone(image_foundation_config(config)),
            "text": prepare_tiny_llama(text_foundation_config(config)),
        }
    )


def check_tuning(config: Any, tuner: str, train_backbone: bool) -> None:
    """A ValueError unless the run tunes TAP's model as it is built: its own LoRA, a frozen
    backbone."""
    if train_backbone:
        raise ValueError("TAP's backbone is frozen and LoRA-tuned; train-backbone must be false")
    if tuner not in ("lora", "auto"):
        raise ValueError(
            f"backbone '{config.backbone}' carries its own LoRA; tuner '{tuner}' "
            "cannot be added to it"
        )


def build_multimodal(
    config: Any,
    tuner: str,
    num_outputs: int,
    *,
    load_weights: bool = True,
    train_backbone: bool = False,
) -> MultiModalMultiTask:
    """TAP's model (``mm-offline``) from the offline ViT (glyph-domains public split) and tiny
    LLaMA (the instruction corpus' public split), with every modality-task pair of the dataset
    (``mm-flava``/``mm-vilt``: ``multimodal_hf.build_hf_multimodal``)."""

    check_tuning(config, tuner, train_backbone)
    image_config = image_foundation_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed + 2)
        vit = vision_backbone(image_config, load_weights=load_weights)
        text_config = text_foundation_config(config)
        if load_weights and config.pretrained:
            lm, tokenizer = foundation.load_language_foundation(**foundation_args(text_config))
        else:
            tokenizer = tokenizer_of(text_config)
            lm = foundation.tiny_llama(tokenizer)
        torch.manual_seed(config.seed)
        rank, alpha, dropout = config.lora_rank, config.lora_alpha, config.lora_dropout
        return MultiModalMultiTask.for_run(
            config,
            ImageEncoder(vit, rank, alpha, dropout),
            TextEncoder(lm, rank, alpha, dropout),
            lm.config.hidden_size,
            [vit.blocks[1], vit.blocks[2]],
            vit.norm,
            tokenizer,
        )
