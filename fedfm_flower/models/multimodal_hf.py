"""TAP's multi-modal multi-task model from the paper's foundation models: FLAVA or ViLT.

Backbones ``mm-flava`` (``facebook/flava-full``) and ``mm-vilt`` (``dandelin/vilt-b32-mlm``)
load run-config key ``model-name-or-path``, a Hugging Face Hub name or a local directory written
by ``save_pretrained`` (checked as for ``hf-causal-lm``: ``causal_lm.model_source`` and
``language.foundation.pretrained_source``), with transformers' ``FlavaModel`` / ``ViltModel``
(a pretraining checkpoint such as ``FlavaForPreTraining`` or ``ViltForMaskedLM`` loads too: its
heads are dropped), and the tokenizer from the same place (``AutoTokenizer``). An empty or
missing path, a checkpoint of the other model, too few layers, an ``image-size`` or
``max-length`` the checkpoint cannot take fail before any weight is read, naming the value. They
build the same ``MultiModalMultiTask`` as ``mm-offline`` (``fedfm_flower.models.multimodal``):
the same components and parameter groups, the same decoders, so TAP, FedAvg and the ownership
logic run unchanged. What comes from where (TAP sec. 5.1):

* ``mm-flava``. Encoders: "the pre-trained image and text encoders", i.e. FLAVA's whole image
  encoder (patch embedding, class token, positions, every layer) and whole text encoder (BERT
  embeddings, every layer), each followed by FLAVA's own projection into the multimodal
  encoder's space (``image_to_mm_projection`` / ``text_to_mm_projection``, applied, as
  ``FlavaModel`` does, to the last layer's output before the unimodal final norm). Backbone:
  "the first two layers of the multi-modal encoder": layer 0 makes the modality stack, layer 1
  the task stack; the final norm is the multimodal encoder's.
* ``mm-vilt``. Encoders: "the module of linear patch projections and word embeddings": image =
  ViLT's patch projection, class token, position embeddings and image modality-type embedding;
  text = ViLT's BERT text embeddings (word, position, token type, LayerNorm) and the text
  modality-type embedding. Backbone: "the first eight layers": layers 0-3 make every layer of
  the modality stack and 4-7 every layer of the task stack (``multimodal.ExpertStack``); the
  final norm is ViLT's.

Every expert is a copy of its layer's pretrained FFN (Wu et al. 2022). ``HFBlock`` gives a
FLAVA/ViLT layer the attribute names of a timm ViT block so that ``multimodal.ExpertBlock``
takes it unchanged; its attention computes what the layer's does (pre-norm, scaled dot product,
the same masks), by ``scaled_dot_product_attention``.

Choices the paper leaves open (ours):

* LoRA targets: ``query`` and ``value`` of every attention in the encoders and the backbone
  (peft's default for BERT-like layers; ``mm-offline`` tunes timm's fused ``qkv``), ``fc1`` and
  ``fc2`` (the layer's ``intermediate.dense`` and ``output.dense``) of every expert. ViLT's
  encoders have no attention; "the encoders are fine-tuned with LoRA" (sec. 5.1) is read as LoRA
  on the patch projection (a convolution: A a rank-r convolution with the patch kernel, B a 1x1
  one) and on the word embeddings (A a rank-r embedding, B a linear map, as peft's
  ``Embedding`` LoRA; no dropout on token ids). One rank, ``lora-rank``, everywhere; the
  paper's Table 21 uses 4 (FLAVA's encoders), 16/8 (backbone attention, FLAVA/ViLT) and 4/8
  (experts).
* Images: the data's ``image-size`` pixels in [0, 1], normalized with the checkpoint's image
  processor mean and std (``preprocessor_config.json`` next to the weights; else the processor
  class's defaults, which are flava-full's and vilt-b32-mlm's), not resized to the checkpoint's
  224 / 384 pixels: the position embeddings are interpolated to the patch grid, bicubically
  (FLAVA's ``interpolate_pos_encoding``) or bilinearly with aligned corners (ViLT's own
  ``visual_embed``). ``image-size`` must be a multiple of the patch size (16 / 32). ViLT keeps
  every patch in raster order (its ``visual_embed`` draws them in a random order when
  ``max_image_length`` is -1; the backbone is order-free, so only the order of the tokens
  differs).
* Text: BERT's tokenizer has no ``<s>``/``</s>``; ``[CLS]`` starts and ``[SEP]`` ends the text
  decoder's targets (``load_tokenizer``), inputs are ``[CLS] text [SEP]`` as the tokenizer makes
  them. ViLT's text embeddings have 40 positions, so ``mm-vilt`` needs ``max-length`` <= 40.
* Unused parts of the checkpoints: FLAVA's multimodal ``[CLS]`` token, poolers, contrastive
  projections and multimodal layers 2-5; ViLT's pooler and layers 8-11. The decoders read the
  masked mean of the backbone's tokens, as for ``mm-offline``.
* Weights are loaded in float32 (``model-dtype`` applies to ``hf-causal-lm`` only). With
  ``pretrained = false`` the architecture is built from the checkpoint's config with random
  weights (as ``mm-offline`` does).

Imports inside functions keep ``transformers`` out of this module's start-up.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.causal_lm import model_source
from fedfm_flower.models.language.foundation import dtype_keyword, pretrained_source
from fedfm_flower.models.multimodal import (
    LoRALayer,
    LoRALinear,
    MultiModalMultiTask,
    check_tuning,
)

# backbone -> (the foundation's name in messages, its transformers model type)
HF_MULTIMODAL: dict[str, tuple[str, str]] = {
    "mm-flava": ("FLAVA", "flava"),
    "mm-vilt": ("ViLT", "vilt"),
}
FLAVA_BACKBONE_LAYERS = 2  # the first layers of FLAVA's multimodal encoder (TAP sec. 5.1)
VILT_BACKBONE_LAYERS = 8  # the first layers of ViLT's transformer (TAP sec. 5.1)
VILT_IMAGE_TYPE, VILT_TEXT_TYPE = 1, 0  # ViLT's modality-type embedding indices


# --- LoRA on embeddings and convolutions ---------------------------------------------------


class LoRAEmbedding(LoRALayer):
    """A frozen embedding plus a trainable low-rank update: E[i] + (alpha / r) B A[:, i]."""

    def __init__(self, base: nn.Embedding, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.num_embeddings))
        self.lora_b = nn.Parameter(torch.zeros(base.embedding_dim, rank))  # starts as identity
        self.scale = alpha / rank

    def low_rank(self, h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """B A[:, ids] of the token ids ``h``."""
        return F.linear(F.embedding(h, a.T), b)


class LoRAConv2d(LoRALayer):
    """A frozen convolution plus a trainable low-rank update: a rank-r convolution with the
    base's kernel and stride (A), then a 1x1 one back to the base's channels (B)."""

    def __init__(self, base: nn.Conv2d, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if base.groups != 1 or base.dilation != (1, 1):
            raise ValueError("LoRAConv2d takes a plain convolution (no groups, no dilation)")
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_channels, *base.kernel_size))
        self.lora_b = nn.Parameter(torch.zeros(base.out_channels, rank))  # starts as identity
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)

    def lora_input(self, x: torch.Tensor) -> torch.Tensor:
        """dropout(x)."""
        return self.dropout(x)

    def low_rank(self, h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """B (A * h): the rank-r convolution, then the 1x1 one."""
        low = F.conv2d(h, a, stride=self.base.stride, padding=self.base.padding)
        return F.conv2d(low, b[:, :, None, None])


def _lora_query_value(self_attention: nn.Module, rank: int, alpha: float, dropout: float) -> None:
    """LoRA on a FLAVA/ViLT self-attention's ``query`` and ``value`` (in place)."""
    self_attention.query = LoRALinear(self_attention.query, rank, alpha, dropout)
    self_attention.value = LoRALinear(self_attention.value, rank, alpha, dropout)


# --- a FLAVA/ViLT layer as a timm block -----------------------------------------------------


class HFAttention(nn.Module):
    """A FLAVA/ViLT layer's attention (``FlavaAttention`` / ``ViltAttention``) called as timm's:
    ``attn(x, attn_mask=)``, ``attn_mask`` True where a key may be attended."""

    lora_targets = ("query", "value")  # what ExpertBlock puts LoRA on

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        inner = attention.attention
        self.query, self.key, self.value = inner.query, inner.key, inner.value
        self.num_heads = inner.num_attention_heads
        self.attention_dropout = inner.dropout.p
        self.proj, self.proj_drop = attention.output.dense, attention.output.dropout

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Multi-head self-attention of ``x`` (B, N, d) and the output projection."""
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.query(x)),
            heads(self.key(x)),
            heads(self.value(x)),
            attn_mask=attn_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
        )
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(batch, length, -1)))


class HFFeedForward(nn.Module):
    """A FLAVA/ViLT layer's FFN (``intermediate``, ``output`` without the residual) as timm's
    ``Mlp``: ``fc1``, activation, ``fc2``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.fc1, self.act = layer.intermediate.dense, layer.intermediate.intermediate_act_fn
        self.fc2, self.drop = layer.output.dense, layer.output.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fc2(act(fc1(x)))."""
        return self.drop(self.fc2(self.act(self.fc1(x))))


class HFBlock(nn.Module):
    """A pre-norm FLAVA/ViLT layer (``FlavaLayer`` / ``ViltLayer``) with the attribute names of a
    timm ViT block, the form ``multimodal.ExpertBlock`` takes. Shares the layer's modules."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn = layer.layernorm_before, HFAttention(layer.attention)
        self.norm2, self.mlp = layer.layernorm_after, HFFeedForward(layer)
        self.ls1, self.ls2 = nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output: x + attn(norm1(x)), then + mlp(norm2(.))."""
        x = x + self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask))
        return x + self.ls2(self.mlp(self.norm2(x)))


# --- encoders ------------------------------------------------------------------------------


class _Normalize(nn.Module):
    """(x - mean) / std per channel, the image processor's normalization."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Normalized images."""
        return (images - self.mean) / self.std


def _frozen_copy(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module).requires_grad_(False)


def _tune_layers(encoder: nn.Module, rank: int, alpha: float, dropout: float) -> None:
    for layer in encoder.encoder.layer:
        _lora_query_value(layer.attention.attention, rank, alpha, dropout)


class FlavaImageEncoder(nn.Module):
    """FLAVA's image encoder (every layer, LoRA on query/value) and its projection into the
    multimodal encoder's space."""

    def __init__(
        self,
        flava: nn.Module,
        normalization: tuple[tuple[float, ...], tuple[float, ...]],
        rank: int,
        alpha: float,
        dropout: float,
    ) -> None:
        super().__init__()
        self.normalize = _Normalize(*normalization)
        self.model = _frozen_copy(flava.image_model)
        self.model.pooler = None
        _tune_layers(self.model, rank, alpha, dropout)
        self.projection = _frozen_copy(flava.image_to_mm_projection)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 1 + patches, d) tokens of images (B, 3, S, S) in [0, 1]."""
        out = self.model(
            pixel_values=self.normalize(images),
            interpolate_pos_encoding=True,
            output_hidden_states=True,
        )
        return self.projection(out.hidden_states[-1])  # before the final norm, as FlavaModel


class FlavaTextEncoder(nn.Module):
    """FLAVA's text encoder (every layer, LoRA on query/value) and its projection into the
    multimodal encoder's space."""

    def __init__(self, flava: nn.Module, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.model = _frozen_copy(flava.text_model)
        self.model.pooler = None
        _tune_layers(self.model, rank, alpha, dropout)
        self.projection = _frozen_copy(flava.text_to_mm_projection)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, d) tokens of ``ids`` (B, T) under ``mask``."""
        out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return self.projection(out.hidden_states[-1])  # before the final norm, as FlavaModel


class ViltImageEncoder(nn.Module):
    """ViLT's linear patch projection (LoRA), class token, interpolated position embeddings and
    image modality-type embedding."""

    def __init__(
        self,
        vilt: nn.Module,
        normalization: tuple[tuple[float, ...], tuple[float, ...]],
        rank: int,
        alpha: float,
        dropout: float,
    ) -> None:
        super().__init__()
        embeddings = vilt.embeddings
        self.normalize = _Normalize(*normalization)
        projection = _frozen_copy(embeddings.patch_embeddings.projection)
        self.projection = LoRAConv2d(projection, rank, alpha, dropout)
        self.cls_token = nn.Parameter(embeddings.cls_token.detach().clone(), requires_grad=False)
        self.position_embeddings = nn.Parameter(
            embeddings.position_embeddings.detach().clone(), requires_grad=False
        )
        self.modality = _frozen_copy(embeddings.token_type_embeddings)
        self.dropout = copy.deepcopy(embeddings.dropout)
        self.grid = vilt.config.image_size // vilt.config.patch_size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 1 + patches, d) tokens of images (B, 3, S, S) in [0, 1], patches in raster
        order."""
        x = self.projection(self.normalize(images))  # (B, d, h, w)
        batch, width, height, columns = x.shape
        spatial = self.position_embeddings[:, 1:].transpose(1, 2)
        spatial = spatial.reshape(1, width, self.grid, self.grid)
        positions = F.interpolate(
            spatial, size=(height, columns), mode="bilinear", align_corners=True
        )
        patches = x.flatten(2).transpose(1, 2) + positions.flatten(2).transpose(1, 2)
        first = (self.cls_token + self.position_embeddings[:, :1]).expand(batch, -1, -1)
        tokens = self.dropout(torch.cat([first, patches], 1))
        return tokens + self.modality.weight[VILT_IMAGE_TYPE]


class ViltTextEncoder(nn.Module):
    """ViLT's text embeddings (LoRA on the word embeddings) and text modality-type embedding."""

    def __init__(self, vilt: nn.Module, rank: int, alpha: float) -> None:
        super().__init__()
        self.embeddings = _frozen_copy(vilt.embeddings.text_embeddings)
        words = self.embeddings.word_embeddings
        self.embeddings.word_embeddings = LoRAEmbedding(words, rank, alpha)
        self.modality = _frozen_copy(vilt.embeddings.token_type_embeddings)
        self.max_length = self.embeddings.position_embeddings.num_embeddings

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, d) embeddings of ``ids`` (B, T); ``mask`` is for the backbone."""
        if ids.shape[1] > self.max_length:
            raise ValueError(f"ViLT embeds at most {self.max_length} tokens, got {ids.shape[1]}")
        return self.embeddings(input_ids=ids) + self.modality.weight[VILT_TEXT_TYPE]


# --- loading -------------------------------------------------------------------------------


def checkpoint_source(config: ExperimentConfig) -> str:
    """What ``from_pretrained`` reads for the configured backbone: ``model-name-or-path``,
    checked as for ``hf-causal-lm`` (set; a local path holds a saved model)."""

    name = HF_MULTIMODAL[config.backbone][0]
    return pretrained_source(model_source(config, f"{name} model"), f"{name} model")


def _cannot_load(config: ExperimentConfig, err: Exception) -> FileNotFoundError:
    name = HF_MULTIMODAL[config.backbone][0]
    return FileNotFoundError(
        f"cannot load {name} model-name-or-path = {config.model_name_or_path!r} for backbone "
        f"'{config.backbone}': {err} (offline, a Hub name must already be in the local Hugging "
        "Face cache)"
    )


def foundation_config(config: ExperimentConfig) -> Any:
    """The checkpoint's ``FlavaConfig`` / ``ViltConfig``, checked to be the backbone's model."""
    from transformers import AutoConfig

    name, model_type = HF_MULTIMODAL[config.backbone]
    source = checkpoint_source(config)
    try:
        architecture = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise _cannot_load(config, err) from err
    if architecture.model_type != model_type:
        raise ValueError(
            f"run config 'model-name-or-path' = {config.model_name_or_path!r} holds a "
            f"'{architecture.model_type}' model; backbone '{config.backbone}' needs a {name} "
            f"checkpoint (model type '{model_type}')"
        )
    return architecture


def load_foundation(
    config: ExperimentConfig, architecture: Any, *, load_weights: bool = True
) -> nn.Module:
    """The configured ``FlavaModel`` / ``ViltModel`` of ``architecture`` in eval mode: the
    checkpoint's weights in float32, or (not ``load_weights``) random weights."""
    from transformers import FlavaModel, ViltModel

    kind = FlavaModel if architecture.model_type == "flava" else ViltModel
    if not load_weights:
        return kind(architecture).eval()
    source = checkpoint_source(config)
    try:
        model = kind.from_pretrained(
            source, config=architecture, **{dtype_keyword(): torch.float32}
        )
    except OSError as err:
        raise _cannot_load(config, err) from err
    return model.eval()


def load_tokenizer(config: ExperimentConfig) -> Any:
    """The checkpoint's tokenizer, right-padding, ``[CLS]``/``[SEP]`` as ``<s>``/``</s>`` where
    it names none (BERT's)."""
    from transformers import AutoTokenizer

    source = checkpoint_source(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise _cannot_load(config, err) from err
    if tokenizer.bos_token is None:
        tokenizer.bos_token = tokenizer.cls_token
    if tokenizer.eos_token is None:
        tokenizer.eos_token = tokenizer.sep_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if None in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id):
        raise ValueError(
            f"the tokenizer of model-name-or-path = {config.model_name_or_path!r} has no "
            "start, end or padding token (nor BERT's [CLS]/[SEP]/[PAD])"
        )
    tokenizer.padding_side = "right"
    return tokenizer


def image_normalization(config: ExperimentConfig) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) of the checkpoint's image processor (``preprocessor_config.json``), else the
    processor class's defaults (FLAVA: CLIP's; ViLT: 0.5)."""
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.image_utils import (
        IMAGENET_STANDARD_MEAN,
        IMAGENET_STANDARD_STD,
        OPENAI_CLIP_MEAN,
        OPENAI_CLIP_STD,
    )

    try:
        saved, _ = ImageProcessingMixin.get_image_processor_dict(checkpoint_source(config))
    except (OSError, json.JSONDecodeError):
        saved = {}
    flava = config.backbone == "mm-flava"
    mean = saved.get("image_mean", OPENAI_CLIP_MEAN if flava else IMAGENET_STANDARD_MEAN)
    std = saved.get("image_std", OPENAI_CLIP_STD if flava else IMAGENET_STANDARD_STD)
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def _check_sizes(config: ExperimentConfig, patch_size: int, text_positions: int) -> None:
    if config.image_size % patch_size:
        raise ValueError(
            f"run config 'image-size' = {config.image_size} is invalid for backbone "
            f"'{config.backbone}': use a multiple of its patch size, {patch_size}"
        )
    if config.max_length > text_positions:
        raise ValueError(
            f"run config 'max-length' = {config.max_length} is invalid for backbone "
            f"'{config.backbone}': its text embeddings have {text_positions} positions"
        )


def _check_depth(config: ExperimentConfig, layers: int, wanted: int) -> None:
    if layers < wanted:
        name = HF_MULTIMODAL[config.backbone][0]
        raise ValueError(
            f"run config 'model-name-or-path' = {config.model_name_or_path!r} is invalid for "
            f"backbone '{config.backbone}': it takes the first {wanted} layers of {name}'s "
            f"{'multimodal encoder' if name == 'FLAVA' else 'transformer'}, the checkpoint has "
            f"{layers}"
        )


def build_hf_multimodal(
    config: ExperimentConfig,
    tuner: str = "auto",
    num_outputs: int = 0,
    *,
    load_weights: bool = True,
    train_backbone: bool = False,
) -> MultiModalMultiTask:
    """TAP's model from the configured FLAVA or ViLT checkpoint, with every modality-task pair
    of the dataset; LoRA and decoders seeded from ``config.seed`` whatever the weights."""
    check_tuning(config, tuner, train_backbone)

    architecture = foundation_config(config)  # checks before any weight is read
    if config.backbone == "mm-flava":
        patch_size = architecture.image_config.patch_size
        text_positions = architecture.text_config.max_position_embeddings
        depth = (architecture.multimodal_config.num_hidden_layers, FLAVA_BACKBONE_LAYERS)
    else:
        patch_size, text_positions = architecture.patch_size, architecture.max_position_embeddings
        depth = (architecture.num_hidden_layers, VILT_BACKBONE_LAYERS)
    _check_sizes(config, patch_size, text_positions)
    _check_depth(config, *depth)
    tokenizer = load_tokenizer(config)
    normalization = image_normalization(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed + 2)
        loads = load_weights and config.pretrained
        foundation = load_foundation(config, architecture, load_weights=loads)
        torch.manual_seed(config.seed)
        rank, alpha, dropout = config.lora_rank, config.lora_alpha, config.lora_dropout
        if config.backbone == "mm-flava":
            image = FlavaImageEncoder(foundation, normalization, rank, alpha, dropout)
            text = FlavaTextEncoder(foundation, rank, alpha, dropout)
            multimodal = foundation.multimodal_model
            layers = multimodal.encoder.layer[:FLAVA_BACKBONE_LAYERS]
            final_norm, text_width = multimodal.layernorm, foundation.mm_hidden_size
        else:
            image = ViltImageEncoder(foundation, normalization, rank, alpha, dropout)
            text = ViltTextEncoder(foundation, rank, alpha)
            layers = foundation.encoder.layer[:VILT_BACKBONE_LAYERS]
            final_norm, text_width = foundation.layernorm, foundation.config.hidden_size
        return MultiModalMultiTask.for_run(
            config,
            image,
            text,
            text_width,
            [HFBlock(layer) for layer in layers],
            final_norm,
            tokenizer,
        )
