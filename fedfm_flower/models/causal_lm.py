"""A frozen Hugging Face causal LM with a parameter-efficient tuner (LoRA by default).

Backbones: ``tiny-llama``, the offline foundation model (a LLaMA-architecture model pretrained
on the public split of the offline instruction data, ``fedfm_flower.models.language``), and
``hf-causal-lm``, any causal LM by Hub name or local path (``model-name-or-path``; LLaMA
family first: LoRA targets ``q_proj``/``v_proj`` by name). The tokenizer travels with the model
(``model.tokenizer``). The backbone is frozen; the tuner's parts are the only trainable tensors
(no task head: the LM head is the backbone's). Tuner parts are seeded from ``config.seed``, so
the server and every client start from the same adapter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedfm_flower.config import ExperimentConfig
from fedfm_flower.models.backbones import freeze
from fedfm_flower.models.groups import TunedModel
from fedfm_flower.models.tuners import get_tuner


class AdaptedCausalLM(TunedModel):
    """Frozen causal LM + the method's tuner; ``tokenizer`` encodes and decodes its text."""

    def __init__(self, lm: nn.Module, tokenizer: Any, config: ExperimentConfig, tuner: str):
        super().__init__()
        freeze(lm)
        parts = get_tuner(tuner)(lm, config)
        self.lm = parts.backbone
        for name, module in parts.modules.items():
            self.add_module(name, module)
        self.tokenizer = tokenizer
        self.group_patterns = parts.patterns

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
    return {
        "cache_dir": config.cache_path,
        "seed": config.seed,
        "public_fraction": config.public_fraction,
        "pretrain_epochs": config.pretrain_epochs,
    }


def tokenizer_of(config: ExperimentConfig) -> Any:
    """The tokenizer of the configured causal LM (the cached one for tiny-llama)."""
    from fedfm_flower.models.language import foundation
    from fedfm_flower.models.language.tokenizer import load_tokenizer

    if config.backbone == "tiny-llama":
        path = foundation.ensure_language_foundation(**foundation_args(config))
        return load_tokenizer(foundation.tokenizer_dir(path))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_model_source(config))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def causal_lm_backbone(config: ExperimentConfig, *, load_weights: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) of the configured causal LM; random weights when not ``load_weights``
    (the tuner's parts do not depend on the backbone's values, only on its shapes)."""
    from fedfm_flower.models.language import foundation

    if config.backbone == "tiny-llama":
        if load_weights and config.pretrained:
            return foundation.load_language_foundation(**foundation_args(config))
        tokenizer = tokenizer_of(config)
        return foundation.tiny_llama(tokenizer), tokenizer
    if load_weights:
        return foundation.load_pretrained_causal_lm(_model_source(config))
    from transformers import AutoConfig, AutoModelForCausalLM

    architecture = AutoConfig.from_pretrained(_model_source(config))
    return AutoModelForCausalLM.from_config(architecture), tokenizer_of(config)


def _model_source(config: ExperimentConfig) -> str:
    if not config.model_name_or_path:
        raise ValueError(
            "run config 'model-name-or-path' = '' is invalid for backbone 'hf-causal-lm': "
            "name a Hugging Face causal LM or a local directory holding one"
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
        return AdaptedCausalLM(lm, tokenizer, config, tuner)


def tiny_llama_card(config: ExperimentConfig) -> dict[str, Any]:
    """The card (ROUGE on the public hold-out, seconds) of the cached tiny-llama; builds it."""
    from fedfm_flower.models.language import language_foundation_card

    return language_foundation_card(**foundation_args(config))
