"""The model-family registry: backbone name -> the family that builds it.

A family builds a frozen backbone from the run config, lets the method's tuner add trainable
parts, adds what the task needs (a classification head for images), and returns a
``fedfm_flower.models.groups.TunedModel``. The registry is plain data (no torch import,
no import at all), so the config can list the allowed backbones from it;
``fedfm_flower.models.build`` imports a family's builder and foundation hook on demand.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFamily:
    """Which backbones a family builds, for which input modality, and with which builder."""

    name: str
    modality: str  # must equal the task's modality
    backbones: tuple[str, ...]
    builder: str  # "module:function(config, tuner, num_outputs, *, load_weights,
    #                 train_backbone) -> TunedModel"
    summary: str
    # "module:function(config) -> card": builds (or finds) the cached foundation model of a
    # backbone this project pretrains itself and returns its JSON card ({} for other
    # backbones); "" when the family has none. The server calls it once before any client.
    foundation: str = ""
    # Its backbones can train whole (train-backbone, or a method that trains the backbone),
    # their weights grouped by role (models.vit_parts, models.resnet_parts); a family without
    # trains its tuner's adapters only (a whole-model method trains LoRA there).
    whole: bool = False
    # The tuners its backbones take; (): every tuner (fedfm_flower.models.tuners).
    tuners: tuple[str, ...] = ()
    # Its models hold BatchNorms with running statistics (they travel with their layer,
    # fedfm_flower.models.groups): a method whose spec cannot carry them is refused.
    batchnorm: bool = False


FAMILIES: dict[str, ModelFamily] = {
    "vit": ModelFamily(
        "vit",
        "image",
        (
            "tiny-vit",
            "small-vit",
            "offline-vit-s",
            "vit_tiny_patch16_224",
            "vit_small_patch16_224",
            "vit_base_patch16_224",
        ),
        "fedfm_flower.models.classifier:build_classifier",
        "timm Vision Transformers with a linear head; tiny-vit, small-vit and offline-vit-s are "
        "pretrained offline on the dataset's public split",
        foundation="fedfm_flower.models.foundation:prepare_offline_backbone",
        whole=True,
    ),
    "resnet": ModelFamily(
        "resnet",
        "image",
        ("tiny-resnet", "small-resnet", "resnet18", "resnet50"),
        "fedfm_flower.models.classifier:build_classifier",
        "timm ResNets with a linear head, trained whole (tuner none; BatchNorm statistics "
        "travel with their layer); tiny-resnet and small-resnet are pretrained offline on the "
        "dataset's public split",
        foundation="fedfm_flower.models.foundation:prepare_offline_backbone",
        whole=True,
        tuners=("none",),
        batchnorm=True,
    ),
    "causal-lm": ModelFamily(
        "causal-lm",
        "text",
        ("tiny-llama", "hf-causal-lm"),
        "fedfm_flower.models.causal_lm:build_causal_lm",
        "Hugging Face causal LMs (LLaMA family); tiny-llama is the offline foundation model, "
        "hf-causal-lm loads model-name-or-path",
        foundation="fedfm_flower.models.causal_lm:prepare_tiny_llama",
    ),
    "multimodal": ModelFamily(
        "multimodal",
        "multimodal",
        ("mm-offline",),
        "fedfm_flower.models.multimodal:build_multimodal",
        "TAP's multi-modal multi-task model: encoders, a MoME/MoTE backbone and task decoders; "
        "mm-offline is built from the offline small-vit and tiny-llama",
        foundation="fedfm_flower.models.multimodal:prepare_mm_offline",
    ),
    "multimodal-hf": ModelFamily(
        "multimodal-hf",
        "multimodal",
        ("mm-flava", "mm-vilt"),
        "fedfm_flower.models.multimodal_hf:build_hf_multimodal",
        "TAP's multi-modal multi-task model built from the FLAVA or ViLT checkpoint at "
        "model-name-or-path",
    ),
}

# Vision backbones this project pretrains itself on a dataset's public split (the offline
# foundation models; architectures in fedfm_flower.models.backbones.OFFLINE_BACKBONES).
OFFLINE_VIT_NAMES: tuple[str, ...] = ("tiny-vit", "small-vit", "offline-vit-s")
OFFLINE_RESNET_NAMES: tuple[str, ...] = ("tiny-resnet", "small-resnet")
OFFLINE_BACKBONE_NAMES: tuple[str, ...] = OFFLINE_VIT_NAMES + OFFLINE_RESNET_NAMES

BACKBONES: tuple[str, ...] = tuple(b for family in FAMILIES.values() for b in family.backbones)


def family_of(backbone: str) -> ModelFamily:
    """The family that builds ``backbone``."""
    for family in FAMILIES.values():
        if backbone in family.backbones:
            return family
    raise ValueError(f"backbone '{backbone}' unknown; allowed: {', '.join(BACKBONES)}")
