"""A study keeps the builds of its foundation models, installs them on a new machine, and no
table pairs runs of one seed made on two builds of one foundation (``foundation_cards``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fedfm_flower.models import foundation_cards as cards
from fedfm_flower.report.runs import load_runs
from fedfm_flower.report.tables import build_cells
from fedfm_flower.study.state import StateError, StudyState

NAME = "small-vit-c0ffee"
WEIGHTS = f"foundation/{NAME}.safetensors"
CARD = f"foundation/{NAME}.json"
BUILT = {"key": "c0ffee", "train_accuracy": 0.84, "public_test_accuracy": 0.956, "seconds": 150.0}


def build(cache: Path, weights: bytes, card: dict | None = None) -> dict:
    """A foundation build in ``cache`` (weights and card) and the card a run records of it."""
    (cache / "foundation").mkdir(parents=True, exist_ok=True)
    (cache / WEIGHTS).write_bytes(weights)
    (cache / CARD).write_text(json.dumps(card or BUILT))
    return cards.identified(card or BUILT, cache, [cache / WEIGHTS, cache / CARD])


def write_run(root: Path, name: str, card: dict, cache: Path, seed: int = 0) -> Path:
    """A finished run directory whose config.json records ``card`` (method from the name)."""
    path = root / name
    path.mkdir(parents=True)
    method = name.split("-")[0]
    config = {"method": method, "setup": "glyphs", "seed": seed, "backbone": "small-vit"}
    config["cache-dir"] = str(cache)
    (path / "config.json").write_text(json.dumps({"run-config": config, "foundation": card}))
    evaluate = {str(c): {"client-id": float(c), "test-accuracy": 0.5 + 0.1 * c} for c in (0, 1)}
    record = {"round": 1, "bytes-down": 1, "bytes-up": 1, "clients-reported": 2}
    (path / "metrics.jsonl").write_text(json.dumps({**record, "evaluate": evaluate}) + "\n")
    (path / "summary.json").write_text(json.dumps({"primary-metric": "accuracy"}))
    return path


def test_a_card_names_its_build_by_the_weights_digest(tmp_path: Path) -> None:
    card = build(tmp_path, b"weights of one machine")
    assert card[cards.WEIGHTS_SHA256] == hashlib.sha256(b"weights of one machine").hexdigest()
    assert card[cards.CACHE_FILES] == [WEIGHTS, CARD]
    other = build(tmp_path / "b", b"weights of another machine")
    assert not cards.same_build(card, other)  # the same recipe (key and accuracies), other bytes
    assert cards.same_build(card, {**card, "seconds": 9.0})
    # older cards (no digest) compare by what the build made; only the times may differ
    assert cards.same_build(BUILT, {**BUILT, "seconds": 1.0})
    timed = {**BUILT, "pretrain_seconds": 47.2}  # tiny-llama's card times its pretraining too
    assert cards.same_build(timed, {**timed, "pretrain_seconds": 49.0})
    assert not cards.same_build(timed, {**timed, "final_train_loss": 0.227})
    assert not cards.same_build(BUILT, {**BUILT, "public_test_accuracy": 0.967})
    assert "public test accuracy 0.9560" in cards.describe(card)


def test_the_offline_vits_hook_records_the_digest_of_the_weights_it_cached(
    cache_dir: Path,
) -> None:
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.models.foundation import foundation_path, prepare_offline_backbone

    config = ExperimentConfig(backbone="tiny-vit", dataset="digits", cache_dir=str(cache_dir))
    card = prepare_offline_backbone(config)
    weights = foundation_path(config)
    assert card[cards.WEIGHTS_SHA256] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert [cache_dir / f for f in card[cards.CACHE_FILES]] == [
        weights,
        weights.with_suffix(".json"),
    ]


def test_a_study_keeps_its_runs_build_and_installs_it_on_a_new_machine(tmp_path: Path) -> None:
    here, there = tmp_path / "cache-here", tmp_path / "cache-there"
    card = build(here, b"the build the runs used")
    state = StudyState(tmp_path / "out", tmp_path / "state")
    run = write_run(tmp_path / "out" / "runs", "fedavg-glyphs-s0", card, here)
    state.keep_run(run)
    kept = tmp_path / "state" / "foundations"
    assert (kept / WEIGHTS).read_bytes() == b"the build the runs used"
    assert json.loads((kept / CARD).read_text()) == BUILT
    # a later run on another build does not replace what the study keeps
    other = build(tmp_path / "cache-b", b"another build")
    state.keep_run(write_run(tmp_path / "out" / "runs", "local-glyphs-s0", other, tmp_path))
    assert (kept / WEIGHTS).read_bytes() == b"the build the runs used"
    # a new machine: the copied state installs the build into its empty cache, once
    assert state.install_foundations(there) == [there / WEIGHTS]
    assert (there / WEIGHTS).read_bytes() == b"the build the runs used"
    assert json.loads((there / CARD).read_text()) == BUILT
    assert state.install_foundations(there) == []
    # the builds stay in the state: restoring into --out does not copy them there
    state.restore()
    assert not (tmp_path / "out" / "foundations").exists()


def test_a_cache_holding_another_build_is_refused_naming_both(tmp_path: Path) -> None:
    card = build(tmp_path / "cache-a", b"the study's build")
    state = StudyState(tmp_path / "out", tmp_path / "state")
    state.keep_run(write_run(tmp_path / "out" / "runs", "fedavg-glyphs-s0", card, tmp_path))
    # keep_run looked in the run's own cache-dir (tmp_path): nothing kept from there
    assert not (tmp_path / "state" / "foundations").exists()
    state.keep_foundation(write_run(tmp_path / "r", "fedavg-glyphs-s0", card, tmp_path / "cache-a"))
    build(tmp_path / "cache-b", b"this machine's build of the same recipe")
    with pytest.raises(StateError, match="another build of this foundation") as refused:
        state.install_foundations(tmp_path / "cache-b")
    assert str(tmp_path / "cache-b" / WEIGHTS) in str(refused.value)
    assert (
        tmp_path / "cache-b" / WEIGHTS
    ).read_bytes() == b"this machine's build of the same recipe"


def test_final_runs_on_another_build_than_the_kept_one_are_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    card = build(cache, b"kept build")
    state = StudyState(tmp_path / "state", tmp_path / "state")
    runs = tmp_path / "state" / "runs"
    state.keep_run(write_run(runs, "fedavg-glyphs-s0", card, cache))
    write_run(runs, "fedrep-glyphs-s0", card, cache)
    write_run(runs, "old-glyphs-s0", dict(BUILT), cache)  # a card from before the digests
    state.check_foundations()  # the same build, by digest and by its accuracies
    other = build(tmp_path / "elsewhere", b"other machine")
    write_run(runs, "local-glyphs-s0", other, cache)
    write_run(runs, "older-glyphs-s0", {**BUILT, "public_test_accuracy": 0.967}, cache)
    with pytest.raises(StateError, match="another build") as refused:
        state.check_foundations()
    said = str(refused.value)
    assert "local-glyphs-s0" in said and "older-glyphs-s0" in said
    assert "fedrep-glyphs-s0" not in said and "old-glyphs-s0 (" not in said


def test_a_report_refuses_runs_of_one_seed_on_two_builds(tmp_path: Path) -> None:
    mine = build(tmp_path / "a", b"one build")
    write_run(tmp_path / "runs", "fedavg-glyphs-s0", mine, tmp_path)
    write_run(tmp_path / "runs", "local-glyphs-s0", mine, tmp_path)
    write_run(tmp_path / "runs", "local-glyphs-s1", build(tmp_path / "c", b"seed 1's"), tmp_path, 1)
    runs, _ = load_runs([tmp_path / "runs"])
    assert set(build_cells(runs, "local")) == {("glyphs", "fedavg"), ("glyphs", "local")}
    write_run(tmp_path / "runs", "fedrep-glyphs-s0", build(tmp_path / "b", b"other"), tmp_path)
    runs, _ = load_runs([tmp_path / "runs"])
    with pytest.raises(ValueError, match="two builds of foundation c0ffee") as refused:
        build_cells(runs, "local")
    assert "fedrep-glyphs-s0" in str(refused.value)
    (tmp_path / "runs" / "fedrep-glyphs-s0" / "summary.json").unlink()  # not reported
    write_run(tmp_path / "runs", "fedprox-glyphs-s0", {**mine, "key": "5eed1"}, tmp_path)
    runs, _ = load_runs([tmp_path / "runs"])
    with pytest.raises(ValueError, match=r"two foundation models \(c0ffee and 5eed1\)"):
        build_cells(runs, "local")


def test_a_composite_models_builds_are_kept_and_checked_part_by_part(tmp_path: Path) -> None:
    """TAP's mm-offline: a card whose parts are the small-vit's and tiny-llama's builds."""
    cache = tmp_path / "cache"
    image = build(cache, b"vit weights")
    (cache / "foundation" / "tiny-llama-beef.tokenizer").mkdir(parents=True)
    (cache / "foundation" / "tiny-llama-beef.tokenizer" / "vocab.json").write_text("{}")
    text_files = [cache / "foundation" / f"tiny-llama-beef.{s}" for s in ("safetensors", "json")]
    text_files[0].write_bytes(b"llama weights")
    text_files[1].write_text(json.dumps({"key": "beef", "seconds": 1.0}))
    text = cards.identified(
        {"key": "beef"},
        cache,
        [*text_files, cache / "foundation/tiny-llama-beef.tokenizer/vocab.json"],
    )
    card = cards.composite({"image": image, "text": text})
    assert card["key"] == "c0ffee+beef" and cards.builds_of(card) == [image, text]
    assert not cards.same_build(card, cards.composite({"image": image, "text": image}))
    state = StudyState(tmp_path / "state", tmp_path / "state")
    state.keep_run(write_run(tmp_path / "state" / "runs", "tap-multitask-s0", card, cache))
    kept = tmp_path / "state" / "foundations" / "foundation"
    assert (kept / "tiny-llama-beef.safetensors").read_bytes() == b"llama weights"
    assert (kept / "tiny-llama-beef.tokenizer" / "vocab.json").is_file()
    assert (kept / f"{NAME}.safetensors").read_bytes() == b"vit weights"
    elsewhere = tmp_path / "elsewhere"
    assert len(state.install_foundations(elsewhere)) == 2
    assert (elsewhere / "foundation" / "tiny-llama-beef.tokenizer" / "vocab.json").is_file()
    state.check_foundations()
    other = {**text, cards.WEIGHTS_SHA256: "0" * 64}
    write_run(
        tmp_path / "state" / "runs",
        "local-multitask-s0",
        cards.composite({"image": image, "text": other}),
        cache,
    )
    with pytest.raises(StateError, match="local-multitask-s0"):
        state.check_foundations()


def test_the_recorded_card_of_a_run_reads_what_config_json_holds_and_nothing_else(
    tmp_path: Path,
) -> None:
    card = {"key": "k1", cards.WEIGHTS_SHA256: "ab" * 32}
    (tmp_path / "config.json").write_text(
        json.dumps({"run-config": {"backbone": "vit"}, "foundation": card})
    )
    assert cards.recorded_card(tmp_path) == (card, {"backbone": "vit"})
    for damaged in ("{not json", "[1, 2]", json.dumps({"foundation": "k1", "run-config": 3})):
        (tmp_path / "config.json").write_text(damaged)
        assert cards.recorded_card(tmp_path) == ({}, {})
    assert cards.recorded_card(tmp_path / "absent") == ({}, {})
