"""Which build of an offline foundation model a run used: the card's identity fields.

An offline foundation (the pretrained tiny ViTs, tiny-llama) is cached under a key that hashes
its *recipe* (architecture, data, epochs, seed), not its weights. The same recipe does not give
the same weights on every machine: 30 epochs of float arithmetic whose kernels differ between
CPUs drift apart (measured here: the glyph ViT of seed 0 reached public test accuracy 0.9667 on
one machine and 0.9563 on another; seed 2's 0.843 and 0.642). Two runs that share a key may so
have run on different models, and a paired comparison of them is not one of equals.

So the card a run records (``config.json``'s ``foundation``) names the build: ``weights-sha256``
(the digest of the weights file it loaded) and ``cache-files`` (the files of the build, relative
to the cache directory: what a study keeps to run on the same build elsewhere,
``fedfm_flower.study.state``). Cards written before these fields existed are compared by their
stable fields (accuracies, sizes): equal builds have equal cards, so a difference there is a
different build, while equal old cards are taken as one build.

A model made of several foundations (TAP's ``mm-offline``: the small-vit and tiny-llama) has a
card whose ``parts`` are the cards of its builds; its key and digest combine theirs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

WEIGHTS_SHA256 = "weights-sha256"
CACHE_FILES = "cache-files"  # the build's files relative to the cache directory, weights first
PARTS = "parts"  # a composite card: {part name: the card of one build}
VOLATILE = frozenset({WEIGHTS_SHA256, CACHE_FILES})  # not part of what was built


def _is_stable(field: str) -> bool:
    """Whether a card field describes the build: not a timing (``seconds``,
    ``pretrain_seconds``: one build made twice takes other times) nor its identity fields."""
    return field not in VOLATILE and not field.endswith("seconds")


def weights_file_name(backbone: str, key: str) -> str:
    """The cache file name of the offline foundation ``backbone`` built from recipe ``key``."""
    return f"{backbone}-{key}.safetensors"


def file_sha256(path: Path) -> str:
    """The SHA-256 of the file at ``path``, in hex."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def identified(card: dict[str, Any], cache_dir: Path, files: Iterable[Path]) -> dict[str, Any]:
    """``card`` with the build's identity: the digest of the weights (the first of ``files``)
    and every file of the build relative to ``cache_dir``."""
    files = list(files)
    return {
        **card,
        WEIGHTS_SHA256: file_sha256(files[0]),
        CACHE_FILES: [str(Path(f).relative_to(cache_dir)) for f in files],
    }


def composite(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The card of a model made of the builds ``parts`` (cards from ``identified``): a key and
    digest over theirs, and the parts themselves."""
    names = sorted(parts)
    combined = hashlib.sha256("".join(parts[n][WEIGHTS_SHA256] for n in names).encode())
    return {
        "key": "+".join(str(parts[n].get("key", "?")) for n in names),
        WEIGHTS_SHA256: combined.hexdigest(),
        PARTS: parts,
    }


def builds_of(card: dict[str, Any]) -> list[dict[str, Any]]:
    """The cards of the single builds a card names: its parts, or itself."""
    return list(card[PARTS].values()) if card.get(PARTS) else [card]


def stable_fields(card: dict[str, Any]) -> str:
    """What the build made (accuracies, sizes, key), as canonical JSON: equal for one build."""
    return json.dumps({k: v for k, v in card.items() if _is_stable(k)}, sort_keys=True)


def same_build(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two cards name one build: equal digests where both have one, else equal stable
    fields."""
    if a.get(WEIGHTS_SHA256) and b.get(WEIGHTS_SHA256):
        return a[WEIGHTS_SHA256] == b[WEIGHTS_SHA256]
    return stable_fields(a) == stable_fields(b)


def model_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How the foundation models of two cards differ, as a phrase ("two foundation models
    (K1 and K2)", "two builds of foundation K (...)"); "" for one model or a card without a key."""
    if not a.get("key") or not b.get("key"):
        return ""
    if a["key"] != b["key"]:
        return f"two foundation models ({a['key']} and {b['key']})"
    if not same_build(a, b):
        return f"two builds of foundation {a['key']} (one recipe, other weights)"
    return ""


def recorded_card(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the foundation card the run at ``run_dir`` recorded in ``config.json``, its run config);
    {} for each that is missing or unreadable."""
    try:
        payload = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}, {}
    if not isinstance(payload, dict):
        return {}, {}
    card, run_config = payload.get("foundation"), payload.get("run-config")
    return (
        card if isinstance(card, dict) else {},
        run_config if isinstance(run_config, dict) else {},
    )


def describe(card: dict[str, Any]) -> str:
    """A short name of the build for messages: key, digest prefix and its accuracies."""
    facts = [str(card.get("key", "?"))]
    if card.get(WEIGHTS_SHA256):
        facts.append(f"sha256 {card[WEIGHTS_SHA256][:12]}")
    for name in ("train_accuracy", "public_test_accuracy"):
        if isinstance(card.get(name), int | float):
            facts.append(f"{name.replace('_', ' ')} {card[name]:.4f}")
    rouge = card.get("public_holdout_rouge")
    if isinstance(rouge, dict) and isinstance(rouge.get("rouge-1"), int | float):
        facts.append(f"public ROUGE-1 {rouge['rouge-1']:.4f}")
    return ", ".join(facts)
