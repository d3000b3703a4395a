"""The tuner table: tuner name -> the ``"module:function"`` path of the function that adds it
(``fedfm_flower.models.tuners.get_tuner`` imports it). A leaf: the config's tuner keys read the
names, and the tuners, which take the config, live above the config.
"""

from __future__ import annotations

TUNERS: dict[str, str] = {
    "lora": "fedfm_flower.models.tuners.lora:lora_tuner",
    "dual-lora": "fedfm_flower.models.tuners.dual_lora:dual_lora_tuner",
    "vpt": "fedfm_flower.models.tuners.prompts:vpt_shallow_tuner",
    "vpt-deep": "fedfm_flower.models.tuners.prompts:vpt_deep_tuner",
    "perfix": "fedfm_flower.models.tuners.prefix:perfix_tuner",
    "prefix-zero": "fedfm_flower.models.tuners.prefix:prefix_zero_tuner",
    "prefix-random": "fedfm_flower.models.tuners.prefix:prefix_random_tuner",
    "mlp-adapter": "fedfm_flower.models.tuners.mlp_adapter:mlp_adapter_tuner",
    "none": "fedfm_flower.models.tuners:no_tuner",
}
