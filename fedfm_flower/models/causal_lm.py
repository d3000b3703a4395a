"""A frozen Hugging Face causal LM with a parameter-efficient tuner (LoRA by default).

Backbones: ``tiny-llama``, the offline foundation model (a LLaMA-architecture model pretrained
on the public split of the offline instruction data, ``fedfm_flower.models.language``), and
``hf-causal-lm``, any causal LM by Hub name or local path (``model-name-or-path``; LLaMA
family first: LoRA targets ``q_proj``/``v_proj`` by name). The tokenizer travels with the model
(``model.tokenizer``). The backbone is frozen; the tuner's parts are the only trainable tensors
(no task head: the LM head is the backbone's). Tuner parts are seeded from ``config.seed``, so
the server and every client start from the same adapter.

``hf-causal-lm`` loads in ``model-dtype`` (``auto``: float32 when the model runs on the CPU, the
checkpoint's own dtype, e.g. LLaMA-7B's float16, when CUDA runs it), optionally placed by
accelerate (``device-map = "auto"``) or with 4-bit weights (``load-in-4bit``); a placed model
is not moved afterwards (``AdaptedCausalLM.placed``). The tuner's parts are kept in float32
whatever the backbone's dtype, as peft's ``autocast_adapter_dtype`` does: the exchanged tensors
then have one dtype on every node and the optimizer steps in full precision (peft casts the
activations to the adapter's dtype and back).

Imports inside functions keep ``transformers`` out of this module's start-up.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.backbones import freeze
from fedfm_flower.models.foundation_cards import identified
from fedfm_flower.models.groups import BACKBONE, TunedModel
from fedfm_flower.models.language import foundation, language_foundation_card
from fedfm_flower.models.language.foundation import (
    dtype_keyword,
    language_foundation_path,
    tokenizer_dir,
)
from fedfm_flower.models.language.tokenizer import load_tokenizer
from fedfm_flower.models.tuners import get_tuner

log = logging.getLogger(__name__)


class AdaptedCausalLM(TunedModel):
    """Frozen causal LM + the method's tuner; ``tokenizer`` encodes and decodes its text."""

    def __init__(
        self,
        lm: nn.Module,
        tokenizer: Any,
        config: ExperimentConfig,
        tuner: str,
        placed: bool = False,
    ):
        super().__init__()
        freeze(lm)
        parts = get_tuner(tuner)(lm, config)
        self.lm = parts.backbone
        for name, module in parts.modules.items():
            self.add_module(name, module)
        self.tokenizer = tokenizer
        self.group_patterns = parts.patterns
        self.placed = placed  # the loader put it on its device(s): ModelCache does not move it
        with torch.no_grad():  # a half-precision backbone gave peft's adapters its dtype
            for _, parameter, group in self._group_index():
                if group != BACKBONE and parameter.dtype in (torch.float16, torch.bfloat16):
                    parameter.data = parameter.data.float()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> Any:
        """The LM's output (``.logits``, and ``.loss`` when ``labels`` are given)."""
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def generate(self, **kwargs: Any) -> torch.Tensor:
        """``generate`` of the underlying LM (the tuner's parts take part)."""
        return self.lm.generate(**kwargs)


def foundation_args(config: ExperimentConfig) -> dict[str, Any]:
    """The arguments that identify the cached tiny-llama of ``config``."""
    # The corpus the clients' data are cut from is the data seed's: pretraining at another
    # seed would put clients' examples in the "public" split (a fixed data-seed at seeds 1-2).
    return {
        "cache_dir": config.cache_path,
        "seed": config.effective_data_seed,
        "public_fraction": config.public_fraction,
        "pretrain_epochs": config.pretrain_epochs,
    }


def tokenizer_of(config: ExperimentConfig) -> Any:
    """The tokenizer of the configured causal LM (the cached one for tiny-llama)."""

    if config.backbone == "tiny-llama":
        path = foundation.ensure_language_foundation(**foundation_args(config))
        return load_tokenizer(foundation.tokenizer_dir(path))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_source(config))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def causal_lm_backbone(config: ExperimentConfig, *, load_weights: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) of the configured causal LM; random weights when not ``load_weights``
    (the tuner's parts do not depend on the backbone's values, only on its shapes)."""

    if config.backbone == "tiny-llama":
        if load_weights and config.pretrained:
            return foundation.load_language_foundation(**foundation_args(config))
        tokenizer = tokenizer_of(config)
        return foundation.tiny_llama(tokenizer), tokenizer
    if load_weights:
        return foundation.load_pretrained_causal_lm(
            model_source(config),
            dtype=load_dtype(config),
            device_map=config.device_map,
            load_in_4bit=config.load_in_4bit,
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    architecture = AutoConfig.from_pretrained(model_source(config))
    # The same dtype as the loaded weights, so the seeded adapter gets the same rounding; peft
    # keeps adapters on 4-bit layers in float32, hence float32 for load-in-4bit.
    dtype = load_dtype(config)
    if config.load_in_4bit or dtype == "float32":
        skeleton = torch.float32
    elif dtype == "auto":
        skeleton = _checkpoint_dtype(architecture)
    else:
        skeleton = getattr(torch, dtype)
    options = {foundation.dtype_keyword(): skeleton}
    return AutoModelForCausalLM.from_config(architecture, **options), tokenizer_of(config)


def load_dtype(config: ExperimentConfig) -> str:
    """``model-dtype`` with ``auto`` resolved for this node: ``float32`` unless CUDA will run
    the model (device not ``cpu`` and CUDA available), then ``auto``, the checkpoint's own."""
    if config.model_dtype != "auto":
        return config.model_dtype
    runs_on_cuda = config.device != "cpu" and torch.cuda.is_available()
    return "auto" if runs_on_cuda else "float32"


def _checkpoint_dtype(architecture: Any) -> torch.dtype:
    """The dtype a checkpoint's config names (float32 when it names none)."""

    named = getattr(architecture, dtype_keyword(), None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else torch.float32


def model_source(config: ExperimentConfig, what: str = "causal LM") -> str:
    """``model-name-or-path``, which a backbone that loads a Hugging Face ``what`` needs (a
    ValueError naming the key and the backbone when it is empty)."""
    if not config.model_name_or_path:
        raise ValueError(
            f"run config 'model-name-or-path' = '' is invalid for backbone '{config.backbone}': "
            f"name a Hugging Face {what} or a local directory holding one"
        )
    return config.model_name_or_path


def build_causal_lm(
    config: ExperimentConfig,
    tuner: str,
    num_outputs: int = 0,
    *,
    load_weights: bool = True,
    train_backbone: bool = False,
) -> AdaptedCausalLM:
    """A fresh AdaptedCausalLM with the tuner's parts seeded from ``config.seed``."""
    if train_backbone:
        raise ValueError(
            f"backbone '{config.backbone}' cannot be trained whole (train-backbone): causal "
            "LMs are tuned with adapters only"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed + 2)
        lm, tokenizer = causal_lm_backbone(config, load_weights=load_weights)
        torch.manual_seed(config.seed)
        placed = load_weights and bool(config.device_map or config.load_in_4bit)
        return AdaptedCausalLM(lm, tokenizer, config, tuner, placed=placed)


def tiny_llama_card(config: ExperimentConfig) -> dict[str, Any]:
    """The card (ROUGE on the public hold-out, seconds) of the cached tiny-llama; builds it."""

    return language_foundation_card(**foundation_args(config))


def prepare_tiny_llama(config: ExperimentConfig) -> dict[str, Any]:
    """The causal-lm family's foundation hook: tiny-llama's card (built if missing) with its
    build's identity (``foundation_cards``), {} for checkpoints loaded from model-name-or-path."""
    if config.backbone != "tiny-llama":
        return {}

    card = tiny_llama_card(config)
    log.info(
        "foundation model %s: public hold-out ROUGE-1 %.3f",
        card.get("key", "tiny-llama"),
        card["public_holdout_rouge"]["rouge-1"],
    )
    weights = language_foundation_path(**foundation_args(config))
    tokenizer = sorted(f for f in tokenizer_dir(weights).rglob("*") if f.is_file())
    return identified(card, config.cache_path, [weights, weights.with_suffix(".json"), *tokenizer])
