"""How well a linear classifier reads the image-cls digits off ``mm-offline``'s image path.

    python -m bench.multitask_image_probe --pairs 0:0 1:1 0:1 1:0 --cache-dir <dir>

For each ``foundation-seed:data-seed`` pair: the offline small-vit of the foundation seed (as
``multitask-cpu`` pretrains it), the ``image-cls`` examples of the data seed (every holder's
train and test split pooled), features of the patch embedding, class token, positions, the
first ``--blocks`` ViT blocks and the final norm (class token and mean patch token
concatenated), and scikit-learn's logistic regression fit on the train rows and scored on the
test rows. Inputs in [0, 1] as the pairs store them, and normalised to [-1, 1] as the ViT was
pretrained (``data.images.normalize``). Written for TAP's image classification that stayed
near chance in some seeds (docs/methods/tap.md#results).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data import multitask as mt
from fedfm_flower.data.images import normalize
from fedfm_flower.models.backbones import offline_vit
from fedfm_flower.models.foundation import foundation_card, load_foundation_weights
from fedfm_flower.models.multimodal import image_foundation_config
from fedfm_flower.study.sweep import cell_config


def setup_config(seed: int, cache_dir: str, setup: str) -> ExperimentConfig:
    """The run config of TAP on ``setup`` at ``seed`` with ``cache_dir``."""
    with tempfile.TemporaryDirectory() as out:
        raw = cell_config("tap", setup, seed, Path(out), {"cache-dir": cache_dir})
    return ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **raw})


def image_cls_split(config: ExperimentConfig) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
    """{"train"|"test": (images in [0, 1], labels)} of every image-cls holder, pooled."""
    settings = mt.MultitaskSettings.of(config)
    parts: dict[str, tuple[list, list]] = {"train": ([], []), "test": ([], [])}
    for client in mt.task_holders("image-cls", config.num_clients):
        train, test = mt.client_examples(settings, client, config.num_clients)["image-cls"]
        for split, examples in (("train", train), ("test", test)):
            parts[split][0].append(examples.images)
            parts[split][1].append(examples.labels)
    return {k: (torch.cat(v[0]), np.concatenate(v[1])) for k, v in parts.items()}


@torch.no_grad()
def features(vit: torch.nn.Module, images: torch.Tensor, blocks: int) -> np.ndarray:
    """Class token and mean patch token after ``blocks`` ViT blocks and the norm."""
    x = vit.patch_embed(images)
    x = torch.cat([vit.cls_token.expand(len(x), -1, -1), x], 1) + vit.pos_embed
    for block in vit.blocks[:blocks]:
        x = block(x)
    x = vit.norm(x)
    return torch.cat([x[:, 0], x[:, 1:].mean(1)], 1).numpy()


def probe(foundation_seed: int, data_seed: int, args: argparse.Namespace) -> list[dict]:
    """Probe accuracies of one (foundation, data) pair, raw and normalised inputs."""
    from sklearn.linear_model import LogisticRegression

    run_config = setup_config(foundation_seed, args.cache_dir, args.setup)
    image_config = image_foundation_config(run_config)
    card = foundation_card(image_config)
    vit = offline_vit(image_config)
    vit.load_state_dict(load_foundation_weights(image_config))
    vit.eval()
    split = image_cls_split(setup_config(data_seed, args.cache_dir, args.setup))
    rows = []
    for inputs, transform in (("[0, 1]", lambda t: t), ("normalised", normalize)):
        x_train = features(vit, transform(split["train"][0]), args.blocks)
        x_test = features(vit, transform(split["test"][0]), args.blocks)
        fit = LogisticRegression(max_iter=2000).fit(x_train, split["train"][1])
        rows.append(
            {
                "foundation-seed": foundation_seed,
                "data-seed": data_seed,
                "foundation-public-test-accuracy": card["public_test_accuracy"],
                "inputs": inputs,
                "blocks": args.blocks,
                "train": len(x_train),
                "test": len(x_test),
                "probe-test-accuracy": float((fit.predict(x_test) == split["test"][1]).mean()),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line per (pair, input range)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=["0:0", "1:1", "0:1", "1:0"])
    parser.add_argument("--setup", default="multitask-cpu")
    parser.add_argument("--blocks", type=int, default=3, help="3: the blocks mm-offline uses")
    parser.add_argument("--cache-dir", required=True)
    args = parser.parse_args(argv)
    for pair in args.pairs:
        foundation_seed, _, data_seed = pair.partition(":")
        for row in probe(int(foundation_seed), int(data_seed), args):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
