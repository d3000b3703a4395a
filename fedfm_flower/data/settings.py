"""The data-relevant part of an experiment config, as a small hashable value.

``ExperimentConfig`` carries training, model and output settings too; keying the in-process
caches on the whole config would rebuild identical data whenever, say, the learning rate
changes. ``DataSettings`` holds exactly the fields that change which samples a client gets or
how they look, so every cache in this package is keyed on it (or on a subset of it).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfm_flower.config.experiment import ExperimentConfig


@dataclass(frozen=True)
class DataSettings:
    """Every setting that changes the prepared data; hashable, so usable as a cache key."""

    dataset: str
    data_dir: str
    cache_dir: str
    partitioner: str
    dirichlet_alpha: float
    classes_per_client: int
    natural_id_column: str
    test_fraction: float
    val_fraction: float
    public_fraction: float
    image_size: int
    seed: int

    @classmethod
    def from_config(cls, config: ExperimentConfig) -> DataSettings:
        """Pick the data fields out of ``config``."""
        return cls(
            dataset=config.dataset,
            data_dir=config.data_dir,
            cache_dir=str(config.cache_path),
            partitioner=config.partitioner,
            dirichlet_alpha=config.dirichlet_alpha,
            classes_per_client=config.classes_per_client,
            natural_id_column=config.natural_id_column,
            test_fraction=config.test_fraction,
            val_fraction=config.val_fraction,
            public_fraction=config.public_fraction,
            image_size=config.image_size,
            seed=config.effective_data_seed,
        )
