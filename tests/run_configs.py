"""Run configs the tests build for any method of the registry."""

from __future__ import annotations

# A dataset and backbone each modality's methods run on (enough for config validation).
MODALITY_BASES: dict[str, dict[str, str]] = {
    "image": {},
    "text": {"dataset": "instructions", "backbone": "tiny-llama"},
    "multimodal": {"dataset": "multitask", "backbone": "mm-offline"},
}


def method_base(method: str) -> dict[str, str]:
    """A run config that ``method`` validates with: its name and a dataset of its modality."""
    from fedfm_flower.methods.registry import method_spec

    modalities = method_spec(method).modalities
    return {"method": method, **MODALITY_BASES[modalities[0] if modalities else "image"]}
