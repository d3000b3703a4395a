"""TAP's multi-modal multi-task data, task (batches, losses, evaluation) and text metrics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedfm_flower.config.experiment import ConfigError, ExperimentConfig
from fedfm_flower.data import multitask as mt
from fedfm_flower.data.glyphs import DOMAINS, GlyphSizes
from fedfm_flower.data.instructions import build_corpus, format_prompt, public_split
from fedfm_flower.tasks import get_task, task_of
from fedfm_flower.tasks import multitask as mtask
from fedfm_flower.tasks.metrics import text_generation as tg
from fedfm_flower.tasks.registry import task_modality
from fedfm_flower.tasks.training import StepTally, train

SIZES = mt.MultitaskSizes(
    image_cls=24,
    image_gen=24,
    vqa=30,
    text_cls=30,
    text_gen=36,
    glyphs=GlyphSizes(per_domain=30, public_per_domain=4),
)
N = 6  # clients: groups {0, 1}, {2, 3}, {4, 5}
S = 16  # image size (the glyphs' 32 resized)
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def settings(cache_dir: Path) -> mt.MultitaskSettings:
    """Small multitask settings over the session's cache."""
    return mt.MultitaskSettings(str(cache_dir), seed=0, image_size=S, sizes=SIZES)


@pytest.fixture(scope="module")
def tokenizer(cache_dir: Path):  # noqa: ANN201 - a transformers tokenizer
    """The tiny LLaMA's tokenizer (2-epoch foundation, shared with the language tests)."""
    return mtask.text_tokenizer(_config(cache_dir, backbone="tiny-vit"))


@pytest.fixture(scope="module")
def everyone(settings: mt.MultitaskSettings) -> dict[int, dict]:
    """Every client's raw examples."""
    return {p: mt.client_examples(settings, p, N) for p in range(N)}


def _config(cache_dir: Path, **changes) -> ExperimentConfig:
    base = {"dataset": "multitask", "cache_dir": str(cache_dir), "pretrain_epochs": 2, "seed": 0}
    return ExperimentConfig(**{**base, **changes})


def _data(settings, tokenizer, partition_id: int) -> mtask.MultitaskData:  # noqa: ANN001
    return mtask.build_client_data(
        settings, tokenizer, partition_id, N, max_length=MAX_LENGTH, max_new_tokens=6
    )


def _pooled(*parts: TensorDataset) -> TensorDataset:
    return TensorDataset(*(torch.cat(ts) for ts in zip(*(p.tensors for p in parts), strict=True)))


class DoubleModel(nn.Module):
    """A tiny stand-in for the multi-modal model's contract (records how it is called)."""

    def __init__(self, tokenizer, image_size: int, width: int = 8) -> None:  # noqa: ANN001
        super().__init__()
        torch.manual_seed(0)
        vocab = len(tokenizer)
        self.tokenizer = tokenizer
        self.task_names = mt.MULTITASK_TASKS
        self.size = image_size
        self.image = nn.Linear(3 * image_size * image_size, width)
        self.text = nn.Embedding(vocab, width)
        self.heads = nn.ModuleDict(
            {t: nn.Linear(width, s.num_classes) for t, s in mt.PAIRS.items() if s.num_classes}
        )
        self.pixels = nn.Linear(width, 3 * image_size * image_size)
        self.targets = nn.Embedding(vocab, width)
        self.out = nn.Linear(width, vocab)
        self.calls: list[tuple] = []

    def context(self, images, ids, mask) -> torch.Tensor:  # noqa: ANN001
        parts = []
        if images is not None:
            parts.append(self.image(images.flatten(1)))
        if ids is not None:
            weights = mask.unsqueeze(-1).float()
            parts.append((self.text(ids) * weights).sum(1) / weights.sum(1).clamp_min(1))
        return sum(parts)

    def forward(self, task, images, text_ids, text_mask, target_ids=None) -> torch.Tensor:  # noqa: ANN001
        self.calls.append((task, images, text_ids, text_mask, target_ids))
        context = self.context(images, text_ids, text_mask)
        kind = mt.PAIRS[task].kind
        if kind == mt.CLASSIFICATION:
            return self.heads[task](context)
        if kind == mt.IMAGE_GENERATION:
            return torch.sigmoid(self.pixels(context)).view(-1, 3, self.size, self.size)
        return self.out(context[:, None] + self.targets(target_ids))

    @torch.no_grad()
    def generate(self, task, images, text_ids, text_mask, max_new_tokens: int) -> torch.Tensor:  # noqa: ANN001
        ids = torch.full((len(text_ids), 1), self.tokenizer.bos_token_id)
        for _ in range(max_new_tokens):
            ids = torch.cat(
                [ids, self(task, images, text_ids, text_mask, ids)[:, -1:].argmax(-1)], 1
            )
        return ids[:, 1:]


# --- pairs, groups, shares -----------------------------------------------------------------


def test_pairs_and_client_groups() -> None:
    assert tuple(mt.PAIRS) == mt.MULTITASK_TASKS
    assert mt.PAIRS["vqa"] == mt.PairSpec("text-generation", ("image", "text"))
    assert mt.PAIRS["image-cls"].num_classes == 10 and mt.PAIRS["text-cls"].num_classes == 5
    tasks = [mt.client_tasks(p, 30) for p in range(30)]
    assert set(tasks[:10]) == {("image-cls", "image-gen")}
    assert set(tasks[10:20]) == {("text-cls", "text-gen")}
    assert set(tasks[20:]) == {("image-cls", "vqa", "text-gen")}
    assert [mt.client_group(p, 4) for p in range(4)] == [0, 0, 1, 2]
    for n in range(3, 41):
        sizes = np.bincount([mt.client_group(p, n) for p in range(n)], minlength=3)
        assert sizes.max() - sizes.min() <= 1 and sizes.min() >= 1
        assert all(mt.task_holders(task, n) for task in mt.MULTITASK_TASKS)
    with pytest.raises(ValueError):
        mt.client_tasks(4, 4)


def test_determinism(settings: mt.MultitaskSettings, everyone: dict) -> None:
    def digests(examples: dict) -> dict:
        return {t: (tr.digest(), te.digest()) for t, (tr, te) in examples.items()}

    mt.task_pools.cache_clear()
    mt._glyph_arrays.cache_clear()
    for p in (0, 4):
        assert digests(mt.client_examples(settings, p, N)) == digests(everyone[p])
    other = mt.MultitaskSettings(settings.cache_dir, seed=1, image_size=S, sizes=SIZES)
    assert digests(mt.client_examples(other, 4, N)) != digests(everyone[4])


def test_shares_are_disjoint_and_skip_public_data(
    settings: mt.MultitaskSettings, everyone: dict
) -> None:
    arrays = mt._glyph_arrays(settings.cache_dir, SIZES.glyphs)
    glyph_tasks: dict[int, str] = {}
    for task in mt.MULTITASK_TASKS:
        held = []
        for p in mt.task_holders(task, N):
            train, test = everyone[p][task]
            assert not set(train.ids) & set(test.ids)
            assert len(test) >= 1 and abs(len(test) - 0.2 * (len(train) + len(test))) < 1
            held += [*train.ids, *test.ids]
        assert len(held) == len(set(held)) == SIZES.total(task)  # disjoint, all used
        for name in held:
            if name.startswith("glyph:"):
                sample = int(name.removeprefix("glyph:"))
                assert not arrays.public[sample]  # never the ViT's public split
                assert glyph_tasks.setdefault(sample, task) == task  # one task per image
    # styles per task
    styles = {t: set() for t in mt.IMAGE_DOMAINS}
    for sample, task in glyph_tasks.items():
        styles[task].add(DOMAINS[arrays.domains[sample]])
    assert styles == {t: set(d) for t, d in mt.IMAGE_DOMAINS.items()}
    # text: never the tiny LLaMA's public split
    public = public_split(build_corpus(0), settings.public_fraction)
    public_prompts = {format_prompt(e.instruction, e.input) for e in public}
    skip = mt.public_text_count(settings.public_fraction)
    for task in ("text-cls", "text-gen"):
        for p in mt.task_holders(task, N):
            for part in everyone[p][task]:
                assert not set(part.prompts) & public_prompts
                assert all(int(name.split(":")[1]) >= skip for name in part.ids)


def test_style_skew_gives_each_image_holder_one_style_from_the_same_images(
    settings: mt.MultitaskSettings, everyone: dict
) -> None:
    """multitask-style-skew: the same images per pair, grouped so that each holder's share comes
    from the styles of its position (first half of a two-style pair's holders: the first
    style); text pairs are unchanged."""
    from dataclasses import replace

    arrays = mt._glyph_arrays(settings.cache_dir, SIZES.glyphs)
    skewed = replace(settings, style_skew=True)
    clients = {p: mt.client_examples(skewed, p, N) for p in range(N)}

    def ids(examples: dict, task: str) -> list[str]:
        return [i for part in examples[task] for i in part.ids]

    def styles(names: list[str]) -> set[str]:
        return {DOMAINS[arrays.domains[int(n.removeprefix("glyph:"))]] for n in names}

    for task, domains in mt.IMAGE_DOMAINS.items():
        holders = mt.task_holders(task, N)
        mixed = [i for p in holders for i in ids(everyone[p], task)]
        grouped = [i for p in holders for i in ids(clients[p], task)]
        assert sorted(grouped) == sorted(mixed)  # the same images, reassigned
        per_holder = [styles(ids(clients[p], task)) for p in holders]
        if len(domains) == 2:  # image-cls, image-gen: an even number of holders here
            half = len(holders) // 2
            expected = [{domains[0]}] * half + [{domains[1]}] * half
            assert per_holder == expected, (task, per_holder)
        assert all(len(s) < len(domains) for s in per_holder)
        # without the skew every holder sees every style of the pair
        assert all(styles(ids(everyone[p], task)) == set(domains) for p in holders if task != "vqa")
    for task in ("text-cls", "text-gen"):
        for p in mt.task_holders(task, N):
            assert [x.digest() for x in clients[p][task]] == [x.digest() for x in everyone[p][task]]
    with pytest.raises(ConfigError, match="multitask-style-skew"):
        ExperimentConfig(dataset="digits").replace(multitask_style_skew=True)
    config = _config(Path(settings.cache_dir), multitask_style_skew=True)
    assert mt.MultitaskSettings.of(config).style_skew
    # the foundations' own configs (other datasets) drop it: their pretraining does not see it
    from fedfm_flower.models.multimodal import image_foundation_config, text_foundation_config

    for derived in (image_foundation_config(config), text_foundation_config(config)):
        assert not derived.multitask_style_skew and derived.dataset != "multitask"


def test_examples_are_right(settings: mt.MultitaskSettings, everyone: dict) -> None:
    arrays = mt._glyph_arrays(settings.cache_dir, SIZES.glyphs)
    native = mt.MultitaskSettings(settings.cache_dir, seed=0, image_size=32, sizes=SIZES)
    cls_train, _ = mt.client_examples(native, 0, N)["image-cls"]
    samples = np.array([int(i.removeprefix("glyph:")) for i in cls_train.ids])
    assert torch.equal(cls_train.images, mt.glyph_pixels(arrays, samples, 32))
    assert np.array_equal(cls_train.labels, arrays.labels[samples])
    vqa_train, _ = everyone[4]["vqa"]
    assert vqa_train.images.shape == (len(vqa_train), 3, S, S)
    assert vqa_train.labels is None
    for name, prompt, answer in zip(
        vqa_train.ids, vqa_train.prompts, vqa_train.targets, strict=True
    ):
        sample = int(name.removeprefix("glyph:"))
        label, domain = int(arrays.labels[sample]), DOMAINS[arrays.domains[sample]]
        assert prompt.startswith("Answer the question based on the image.\nQuestion: ")
        assert prompt.endswith("\nAnswer:")
        expected = {
            "What digit is shown?": mt.DIGIT_WORDS[label],
            "Which number is in the image?": mt.DIGIT_WORDS[label],
            "What is the style of the image?": mt.STYLE_WORDS[domain],
            "Is the digit even or odd?": ("odd", "even")[label % 2 == 0],
        }
        assert answer == expected[prompt.split("Question: ")[1].split("\n")[0]]
    text_cls, _ = everyone[2]["text-cls"]
    assert text_cls.images is None and all("OPTIONS:" in p for p in text_cls.prompts)
    assert set(text_cls.labels.tolist()) <= set(range(5))
    corpus = build_corpus(0, 400)
    for name, label in zip(text_cls.ids, text_cls.labels.tolist(), strict=True):
        index = int(name.split(":")[1])
        assert mt.TEXT_CLASSES[label] == corpus.by_task["question_classification"][index].output
    text_gen, _ = everyone[2]["text-gen"]
    assert all(t.endswith(".") for t in text_gen.targets) and text_gen.labels is None


def test_counts_without_building(settings: mt.MultitaskSettings, everyone: dict) -> None:
    for p in range(N):
        counts = mt.client_counts(settings, p, N)
        assert counts == {t: (len(tr), len(te)) for t, (tr, te) in everyone[p].items()}
    config = _config(Path(settings.cache_dir), test_fraction=0.2)
    counts = get_task("multimodal-multitask").example_counts(config, 30)
    assert (counts[0].train, counts[0].test) == (96, 24)  # image-cls 60 + image-gen 60
    assert (counts[25].train, counts[25].test) == (144, 36)  # three pairs of 60
    labels = task_of(config).client_labels(config, 30)
    assert labels["0"] == "image-cls+image-gen" and labels["29"] == "image-cls+vqa+text-gen"


def test_registered() -> None:
    config = ExperimentConfig(dataset="multitask")
    task = task_of(config)
    assert isinstance(task, mtask.MultimodalMultitask)
    assert task_modality("multimodal-multitask") == "multimodal" == task.modality
    assert task.primary_metric == "task-score"


def test_text_tokenizer_is_the_tiny_llamas(cache_dir: Path, tokenizer) -> None:  # noqa: ANN001
    llama = mtask.text_tokenizer(_config(cache_dir, backbone="tiny-llama"))
    assert llama.get_vocab() == tokenizer.get_vocab()


# --- batches ---------------------------------------------------------------------------------


def test_batch_contract(settings: mt.MultitaskSettings, tokenizer) -> None:  # noqa: ANN001
    data = _pooled(*(_data(settings, tokenizer, p).train for p in (0, 2, 4)))
    task = get_task("multimodal-multitask")
    batches = list(task.batches(data, 9, torch.Generator().manual_seed(0)))
    assert sum(len(b[0]) for b in batches) == len(data)
    assert any(len(b[0].unique()) > 1 for b in batches)  # pairs mixed in a batch
    pad, bos, eos = tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    for batch in batches:
        assert len(batch) == 8
        task_index, images, ids, mask, labels, target_images, target_ids, target_mask = batch
        b = len(task_index)
        assert task_index.dtype == ids.dtype == mask.dtype == labels.dtype == torch.long
        assert images.shape == target_images.shape == (b, 3, S, S)
        assert images.dtype == torch.float32 and 0 <= images.min() and images.max() <= 1
        assert ids.shape == mask.shape and target_ids.shape == target_mask.shape
        assert ids.shape[1] == max(int(mask.sum(1).max()), 1)  # trimmed to the longest row
        assert target_ids.shape[1] == max(int(target_mask.sum(1).max()), 1)
        lengths = mask.sum(1)
        assert torch.equal(mask, (torch.arange(ids.shape[1]) < lengths[:, None]).long())
        assert torch.all(ids[mask == 0] == pad)  # right padding
        for row in range(b):
            name = mt.MULTITASK_TASKS[task_index[row]]
            spec = mt.PAIRS[name]
            assert (images[row].abs().sum() > 0) == ("image" in spec.modalities)
            assert (lengths[row] > 0) == ("text" in spec.modalities)
            if "text" in spec.modalities:
                assert ids[row, 0] == bos
            assert (labels[row] >= 0) == (spec.kind == mt.CLASSIFICATION)
            if spec.kind == mt.IMAGE_GENERATION:
                assert torch.equal(target_images[row], images[row])
            else:
                assert target_images[row].abs().sum() == 0
            used = int(target_mask[row].sum())
            assert (used > 0) == (spec.kind == mt.TEXT_GENERATION)
            if used:
                assert target_ids[row, 0] == bos and target_ids[row, used - 1] == eos
                assert torch.all(target_ids[row, used:] == pad)


def test_decode_generated_stops_at_eos(tokenizer) -> None:  # noqa: ANN001
    seven = tokenizer("seven", add_special_tokens=False)["input_ids"]
    row = [*seven, tokenizer.eos_token_id, *seven, tokenizer.pad_token_id]
    ids = torch.tensor([row, [*seven, *seven, tokenizer.pad_token_id, tokenizer.pad_token_id]])
    assert mtask.decode_generated(tokenizer, ids) == ["seven", "sevenseven"]


# --- losses ----------------------------------------------------------------------------------


def _independent_losses(model: DoubleModel, batch) -> dict[str, tuple[float, int]]:  # noqa: ANN001
    """{pair: (mean loss, rows)}, computed row by row from the untrimmed batch."""
    task_index, images, ids, mask, labels, target_images, target_ids, target_mask = batch
    losses = {}
    for index, name in enumerate(mt.MULTITASK_TASKS):
        rows = [r for r in range(len(task_index)) if task_index[r] == index]
        if not rows:
            continue
        spec = mt.PAIRS[name]
        image = images[rows] if "image" in spec.modalities else None
        text = (ids[rows], mask[rows]) if "text" in spec.modalities else (None, None)
        if spec.kind == mt.CLASSIFICATION:
            log_p = torch.log_softmax(model(name, image, *text), -1)
            terms = [-log_p[k, labels[r]] for k, r in enumerate(rows)]
        elif spec.kind == mt.IMAGE_GENERATION:
            out = model(name, image, *text)
            terms = [((out - target_images[rows]) ** 2).mean()]
        else:
            log_p = torch.log_softmax(model(name, image, *text, target_ids[rows]), -1)
            terms = [
                -log_p[k, t, target_ids[r, t + 1]]
                for k, r in enumerate(rows)
                for t in range(target_ids.shape[1] - 1)
                if target_mask[r, t + 1]
            ]
        losses[name] = (float((sum(terms) / len(terms)).detach()), len(rows))
    return losses


def test_step_is_taps_weighted_loss(settings: mt.MultitaskSettings, tokenizer) -> None:  # noqa: ANN001
    data = _pooled(*(_data(settings, tokenizer, p).train for p in (0, 2, 4)))
    model = DoubleModel(tokenizer, S)
    task = get_task("multimodal-multitask")
    batch = next(task.batches(data, 24, torch.Generator().manual_seed(1)))
    result = task.step(model, batch)
    expected = _independent_losses(model, batch)
    assert len(expected) >= 4
    b = len(batch[0])
    total = sum(loss * n / b for loss, n in expected.values())
    assert result.count == b
    assert result.loss.item() == pytest.approx(total, rel=1e-5)
    for name, (loss, n) in expected.items():
        assert result.sums[f"count-{name}"] == n
        assert result.sums[f"loss-{name}"] == pytest.approx(loss * n, rel=1e-5)
    # every call carries only the pair's modalities, trimmed to the pair's longest row
    for name, images, ids, mask, target_ids in model.calls[: len(expected)]:
        spec = mt.PAIRS[name]
        assert (images is None) == ("image" not in spec.modalities)
        assert (ids is None) == ("text" not in spec.modalities)
        if ids is not None:
            assert ids.shape[1] == int(mask.sum(1).max())
        assert (target_ids is None) == (spec.kind != mt.TEXT_GENERATION)
    outputs = mtask.task_outputs(model, batch)
    assert set(outputs) == set(expected)
    text = outputs["text-gen"]
    assert text.outputs.shape[:2] == text.targets.shape == text.token_mask.shape
    assert text.units == int(batch[7][text.rows, 1:].sum())
    result.loss.backward()  # differentiable


def test_task_losses_recover_each_pairs_mean_and_share_weighted_loss(
    settings: mt.MultitaskSettings,
    tokenizer,  # noqa: ANN001
) -> None:
    """``pair-mean``: the pair's per-example mean; ``share-weighted`` (the authors'
    ``train_client``): sum over batches of (n_o / B) * loss_o, over all batches, a batch
    without the pair counting 0. Batches of 4 over the client's rows: the last one is short."""
    import dataclasses

    data = _data(settings, tokenizer, 4)
    model = DoubleModel(tokenizer, S)
    task = get_task("multimodal-multitask")
    tally, totals, shares, batches = StepTally(), {}, {}, 0
    with torch.no_grad():
        for batch in task.batches(data.train, 4, torch.Generator().manual_seed(2)):
            tally.add(task.step(model, batch))
            batches += 1
            for name, (loss, n) in _independent_losses(model, batch).items():
                total, count = totals.get(name, (0.0, 0))
                totals[name] = (total + loss * n, count + n)
                shares[name] = shares.get(name, 0.0) + loss * n / len(batch[0])
    stats = dataclasses.replace(tally.stats(), num_steps=batches)
    assert len(data.train) % 4 != 0  # a short batch, whose B is its own length
    recovered = mtask.task_losses(stats, "pair-mean")
    assert set(recovered) == set(data.tasks) == {"image-cls", "vqa", "text-gen"}
    for name, (total, count) in totals.items():
        assert recovered[name] == pytest.approx(total / count, rel=1e-5)
    weighted = mtask.task_losses(stats, "share-weighted")
    for name, share in shares.items():
        assert weighted[name] == pytest.approx(share / batches, rel=1e-5)
        assert weighted[name] < recovered[name]  # each pair is a share of the batch
    with pytest.raises(ValueError, match="'mean'"):
        mtask.task_losses(stats, "mean")
    stats = train(task, model, data.train, model.parameters(), ExperimentConfig(), seed=0)
    assert set(mtask.task_losses(stats, "share-weighted")) == set(data.tasks)


# --- evaluation --------------------------------------------------------------------------------


def test_evaluate_reports_each_pair(settings: mt.MultitaskSettings, tokenizer) -> None:  # noqa: ANN001
    task = get_task("multimodal-multitask")
    model = DoubleModel(tokenizer, S)
    for p, keys in (
        (0, {"accuracy-image-cls", "mse-image-gen"}),
        (4, {"accuracy-image-cls", "bertscore-vqa", "meteor-vqa", "bertscore-text-gen"}),
    ):
        data = _data(settings, tokenizer, p)
        stats = task.evaluate(model, data.test, torch.device("cpu"), 4)
        assert stats.num_examples == len(data.test)
        assert keys <= set(stats.metrics)
        losses = [stats.metrics[f"loss-{t}"] for t in data.tasks]
        assert stats.loss == pytest.approx(sum(losses) / len(losses))
        parts = []
        for name in data.tasks:
            kind = mt.PAIRS[name].kind
            if kind == mt.CLASSIFICATION:
                parts.append(stats.metrics[f"accuracy-{name}"])
            elif kind == mt.IMAGE_GENERATION:
                parts.append(1 - stats.metrics[f"mse-{name}"])
            else:
                parts.append(stats.metrics[f"bertscore-{name}"])
                assert 0 <= stats.metrics[f"meteor-{name}"] <= 1
        assert stats.metrics["task-score"] == pytest.approx(sum(parts) / len(parts))
        assert all(0 <= v <= 1 for k, v in stats.metrics.items() if not k.startswith("loss"))
    assert stats.metrics["meteor-wordnet"] == float(tg.meteor_variant() == "wordnet")


# --- text metrics ------------------------------------------------------------------------------


def test_bertscore_matches_an_independent_computation() -> None:
    same = tg.bertscore(["Ann is a baker from Oslo."], ["Ann is a baker from Oslo."])
    assert same.f1 == pytest.approx(1.0, abs=1e-5)
    candidates = ["the cat sat on the mat", "seven", ""]
    references = ["a cat was sitting on a mat", "the digit seven", "odd"]
    scores = tg.bertscore(candidates, references)
    embeddings = [e.numpy().astype(np.float64) for e in tg.token_embeddings(candidates)]
    targets = [e.numpy().astype(np.float64) for e in tg.token_embeddings(references)]
    assert [len(e) for e in embeddings] == [6, 1, 0]  # [CLS] and [SEP] dropped
    f1s = []
    for c, r in zip(embeddings, targets, strict=True):
        if len(c) == 0:
            f1s.append(0.0)
            continue
        c = c / np.linalg.norm(c, axis=1, keepdims=True)
        r = r / np.linalg.norm(r, axis=1, keepdims=True)
        sim = c @ r.T
        p, rec = sim.max(1).mean(), sim.max(0).mean()
        f1s.append(2 * p * rec / (p + rec))
    assert scores.f1_per_example == pytest.approx(f1s, abs=1e-5)
    assert scores.f1 == pytest.approx(np.mean(f1s), abs=1e-5)
    assert 0 < f1s[0] < 1


def test_meteor_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tg, "_wordnet", lambda: None)  # the exact+stem variant
    assert tg.meteor_variant() == "exact+stem"
    # 6 of 6 hypothesis words match 6 of 7 reference words in 2 chunks (the cat | sat on the mat)
    precision, recall = 1.0, 6 / 7
    f_mean = 10 * precision * recall / (recall + 9 * precision)
    expected = f_mean * (1 - 0.5 * (2 / 6) ** 3)
    assert tg.meteor(["the cat sat on the mat"], ["The cat was sat on the mat"]) == (
        pytest.approx(expected)
    )
    # stems: runs ~ running; quickly !~ quick: 2 of 3 each way, one chunk
    stem = (2 / 3) * (1 - 0.5 * (1 / 2) ** 3)
    assert tg.meteor(["he runs quickly"], ["he running quick"]) == pytest.approx(stem)
    assert tg.meteor(["seven", "odd"], ["seven", "even"]) == pytest.approx(
        (1 - 0.5 * 1.0) / 2  # one exact single-word match (penalty 0.5), one miss
    )
    assert tg.meteor_tokens("Ann, a baker.") == ["ann", ",", "a", "baker", "."]


def test_validation_split_comes_out_of_train_and_leaves_test_alone(
    settings: mt.MultitaskSettings,
    everyone: dict,
    tokenizer,  # noqa: ANN001
) -> None:
    import dataclasses
    import math

    with_val = dataclasses.replace(settings, val_fraction=0.25)
    for p in range(N):
        for task, (rest, test, val) in mt.client_splits(with_val, p, N).items():
            old_train, old_test = everyone[p][task]
            assert test.ids == old_test.ids  # the test split does not move
            assert set(rest.ids) | set(val.ids) == set(old_train.ids)
            assert not set(rest.ids) & set(val.ids)
            share = len(old_train.ids) + len(old_test.ids)
            assert len(val.ids) == max(1, math.floor(0.25 * share))
    data = _data(with_val, tokenizer, 2)
    held = mt.client_splits(with_val, 2, N)
    assert len(data.val) == sum(len(v.ids) for _, _, v in held.values())
    assert data.val.references == tuple(t for _, _, v in held.values() for t in v.targets)
    assert _data(settings, tokenizer, 2).val is None  # val-fraction 0: no validation split
