"""The language stack: instruction corpus and splits, tokenizer, encoding, generation, ROUGE,
the cached tiny-LLaMA foundation model and the loader of real checkpoints. No network."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("rouge_score")

from fedfm_flower.data.instructions import (  # noqa: E402
    CLASSIFICATION,
    GENERATION,
    INSTRUCTION_TASKS,
    Example,
    build_corpus,
    client_split,
    client_task,
    format_prompt,
    public_split,
    task_kind,
)
from fedfm_flower.models.language import foundation  # noqa: E402
from fedfm_flower.models.language.encoding import (  # noqa: E402
    IGNORE_INDEX,
    encode_for_training,
    encode_prompts,
    encoded_length,
    references,
)
from fedfm_flower.models.language.generate import generate  # noqa: E402
from fedfm_flower.models.language.tokenizer import (  # noqa: E402
    build_tokenizer,
    corpus_texts,
    load_tokenizer,
    save_tokenizer,
)
from fedfm_flower.tasks.metrics.rouge import rouge_scores  # noqa: E402

SEED = 0
PUBLIC, TEST = 0.3, 0.2
SMALL = 60  # examples per task for the foundation built in these tests
EPOCHS = 2


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread while this module runs, restored after: on a shared 2-core machine,
    two threads per process that wait on each other made these tiny models ~5x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def key(example: Example) -> tuple[str, str]:
    return example.instruction, example.input


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(SEED)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return build_tokenizer(corpus.examples())


@pytest.fixture(scope="module")
def language_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding one small foundation model, built once for the module."""
    cache = tmp_path_factory.mktemp("language-cache")
    foundation.ensure_language_foundation(cache, SEED, PUBLIC, EPOCHS, examples_per_task=SMALL)
    return cache


@pytest.fixture(scope="module")
def pretrained(language_cache):
    return foundation.load_language_foundation(
        language_cache, SEED, PUBLIC, EPOCHS, examples_per_task=SMALL
    )


# --- corpus and splits -----------------------------------------------------------------------


def test_corpus_is_deterministic_per_seed(corpus):
    assert build_corpus(SEED) == corpus
    other = build_corpus(SEED + 1)
    assert other.by_task.keys() == corpus.by_task.keys()
    for task in INSTRUCTION_TASKS:
        assert other.by_task[task] != corpus.by_task[task]


def test_corpus_has_eight_tasks_of_both_kinds_with_short_outputs(corpus):
    assert len(INSTRUCTION_TASKS) >= 8
    assert {task_kind(t) for t in INSTRUCTION_TASKS} == {GENERATION, CLASSIFICATION}
    instructions = {t: {e.instruction for e in corpus.by_task[t]} for t in INSTRUCTION_TASKS}
    for task, examples in corpus.by_task.items():
        assert 150 <= len(examples) <= 300
        assert all(e.task == task for e in examples)
        assert len({e.input for e in examples}) == len(examples)  # no input twice
        assert all(0 < len(e.output.split()) <= 12 for e in examples)
        for other in INSTRUCTION_TASKS:  # each task has its own instructions
            assert other == task or not instructions[task] & instructions[other]
        if task_kind(task) == CLASSIFICATION:
            assert len({e.output for e in examples}) <= 5
        else:
            assert len({e.output for e in examples}) > len(examples) // 2


@pytest.mark.parametrize("num_partitions", [8, 16])
def test_public_split_is_held_by_no_client(corpus, num_partitions):
    public = {key(e) for e in public_split(corpus, PUBLIC)}
    assert len(public) == sum(round(PUBLIC * len(v)) for v in corpus.by_task.values())
    for pid in range(num_partitions):
        train, test = client_split(corpus, pid, num_partitions, PUBLIC, TEST, SEED)
        assert not public & {key(e) for e in train + test}


@pytest.mark.parametrize("num_partitions", [8, 16])
def test_client_splits_are_disjoint_single_task_and_sized(corpus, num_partitions):
    seen: set[tuple[str, str]] = set()
    for pid in range(num_partitions):
        train, test = client_split(corpus, pid, num_partitions, PUBLIC, TEST, SEED)
        assert {e.task for e in train + test} == {client_task(pid)}
        assert client_task(pid) == INSTRUCTION_TASKS[pid % len(INSTRUCTION_TASKS)]
        keys = {key(e) for e in train} | {key(e) for e in test}
        assert len(keys) == len(train) + len(test)  # train and test disjoint
        assert not keys & seen  # no two clients share an example
        seen |= keys
        if num_partitions == 8:
            assert len(train) >= 10 and len(test) >= 5
            assert len(test) == int(TEST * (len(train) + len(test)))
    public = len(public_split(corpus, PUBLIC))
    assert public + len(seen) == len(corpus.examples())  # together they cover the corpus


def test_client_test_split_is_seeded(corpus):
    first = client_split(corpus, 3, 8, PUBLIC, TEST, SEED)
    assert client_split(corpus, 3, 8, PUBLIC, TEST, SEED) == first
    other = client_split(corpus, 3, 8, PUBLIC, TEST, SEED + 1)
    assert set(other[0] + other[1]) == set(first[0] + first[1])
    assert set(other[1]) != set(first[1])


def test_prompt_template_is_feddpa_table_7():
    prompt = format_prompt("Sort these words alphabetically.", "")
    assert prompt == "### Instruction:\nSort these words alphabetically.\n\n### Response:\n"
    # Table 7 typesets it as "Instruction: {instruction} Response:" (headers in bold).
    table_7 = re.sub(r"\s+", " ", prompt.replace("#", "")).strip()
    assert table_7 == "Instruction: Sort these words alphabetically. Response:"
    assert format_prompt("Do it.", "List: b a") == (
        "### Instruction:\nDo it.\nList: b a\n\n### Response:\n"
    )


# --- tokenizer and encoding ------------------------------------------------------------------


def test_tokenizer_round_trips_corpus_text_without_unknowns(corpus, tokenizer, tmp_path):
    texts = corpus_texts(corpus.examples()) + corpus_texts(build_corpus(SEED + 7).examples())
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.padding_side == "left"
    assert build_tokenizer(corpus.examples()).get_vocab() == tokenizer.get_vocab()
    save_tokenizer(tokenizer, tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded.padding_side == "left"
    assert loaded(texts[:5])["input_ids"] == tokenizer(texts[:5])["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id) == (
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
    )


def test_encoding_masks_prompt_and_padding_and_keeps_response(corpus, tokenizer):
    examples = [corpus.by_task[t][0] for t in INSTRUCTION_TASKS]
    length = encoded_length(tokenizer, examples) + 3
    input_ids, attention_mask, labels = encode_for_training(tokenizer, examples, length).tensors
    assert input_ids.shape == attention_mask.shape == labels.shape == (len(examples), length)
    for row, example in enumerate(examples):
        prompt = format_prompt(example.instruction, example.input)
        joined = tokenizer(prompt + example.output)["input_ids"] + [tokenizer.eos_token_id]
        real = int(attention_mask[row].sum())
        assert input_ids[row, :real].tolist() == joined  # same as tokenizing the joined text
        assert attention_mask[row, real:].eq(0).all() and attention_mask[row, :real].eq(1).all()
        assert input_ids[row, real:].eq(tokenizer.pad_token_id).all()  # right padding
        prompt_len = len(tokenizer(prompt)["input_ids"])
        assert labels[row, :prompt_len].eq(IGNORE_INDEX).all()
        assert labels[row, real:].eq(IGNORE_INDEX).all()
        kept = labels[row, prompt_len:real].tolist()
        assert kept == input_ids[row, prompt_len:real].tolist()
        assert tokenizer.decode(kept[:-1]) == example.output and kept[-1] == tokenizer.eos_token_id
    cut = encode_for_training(tokenizer, examples[:1], 5).tensors
    assert cut[0].shape == (1, 5)  # cut at the right, like FedDPA's cutoff_len


def test_prompts_and_references(corpus, tokenizer):
    examples = corpus.by_task["summarization"][:3]
    prompts = encode_prompts(tokenizer, examples)
    assert prompts == [format_prompt(e.instruction, e.input) for e in examples]
    assert references(examples) == [e.output for e in examples]
    long = Example("x", "word " * 400, "", "y")
    with pytest.raises(ValueError, match="over"):
        encode_prompts(tokenizer, [long])


# --- ROUGE -----------------------------------------------------------------------------------


def test_rouge_matches_hand_computed_values():
    # "the cat sat on the mat" vs "the cat lay on the mat": 5 of 6 unigrams (the x2, cat, on,
    # mat), 3 of 5 bigrams (the cat, on the, the mat), LCS 5; the second pair shares nothing.
    scores = rouge_scores(["the cat sat on the mat", "hello"], ["the cat lay on the mat", "bye"])
    assert scores == pytest.approx({"rouge-1": 5 / 12, "rouge-2": 3 / 10, "rouge-l": 5 / 12})
    # 4 predicted tokens all in the 6-token reference: P = 1, R = 2/3, F = 0.8; bigrams 3 of 5.
    # Case and punctuation are ignored, "bakers" stems to "baker".
    scores = rouge_scores(["Ann is a bakers"], ["Ann is a baker from Oslo."])
    assert scores == pytest.approx({"rouge-1": 0.8, "rouge-2": 0.75, "rouge-l": 0.8})
    assert rouge_scores(["yes"], ["yes"]) == {"rouge-1": 1.0, "rouge-2": 0.0, "rouge-l": 1.0}
    with pytest.raises(ValueError):
        rouge_scores(["a"], [])


# --- the foundation model ----------------------------------------------------------------------


def test_foundation_is_cached_and_reused(language_cache, monkeypatch):
    path = foundation.language_foundation_path(
        language_cache, SEED, PUBLIC, EPOCHS, examples_per_task=SMALL
    )
    assert path.is_file() and path.parent.name == "foundation"
    assert (foundation.tokenizer_dir(path) / "tokenizer.json").is_file()
    card = json.loads(path.with_suffix(".json").read_text())
    assert card["key"] in path.name and card["epochs"] == EPOCHS
    assert set(card["public_holdout_rouge"]) == {"rouge-1", "rouge-2", "rouge-l"}
    assert all(0.0 <= v <= 1.0 for v in card["public_holdout_rouge"].values())
    assert card["public_holdout_examples"] > 0 and card["seconds"] > 0
    modified = path.stat().st_mtime_ns

    def no_retraining(*args, **kwargs):
        raise AssertionError("the cached foundation model was pretrained again")

    monkeypatch.setattr(foundation, "pretrain_language_foundation", no_retraining)
    args = (language_cache, SEED, PUBLIC, EPOCHS)
    assert foundation.ensure_language_foundation(*args, examples_per_task=SMALL) == path
    assert foundation.language_foundation_card(*args, examples_per_task=SMALL) == card
    foundation.load_language_foundation(*args, examples_per_task=SMALL)
    assert path.stat().st_mtime_ns == modified
    other = foundation.language_foundation_path(language_cache, SEED + 1, PUBLIC, EPOCHS, SMALL)
    assert other != path  # the seed is part of the key


def test_loaded_foundation_is_an_eval_llama_with_its_tokenizer(pretrained):
    from transformers import LlamaForCausalLM

    model, tokenizer = pretrained
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.hidden_size == foundation.TINY_LLAMA.hidden_size
    assert tokenizer.padding_side == "left"


def test_generate_is_batch_equivalent_and_returns_new_text_only(pretrained, corpus):
    model, tokenizer = pretrained
    examples = [corpus.by_task[t][i] for t in INSTRUCTION_TASKS for i in range(2)]
    prompts = encode_prompts(tokenizer, examples)
    one = generate(model, tokenizer, prompts, max_new_tokens=8, batch_size=1, device="cpu")
    four = generate(model, tokenizer, prompts, max_new_tokens=8, batch_size=4, device="cpu")
    assert one == four
    assert len(one) == len(prompts)
    assert all(text == text.strip() and "### Instruction" not in text for text in one)
    assert generate(model, tokenizer, prompts[:3], 8, 2, "cpu") == one[:3]  # deterministic
    assert tokenizer.padding_side == "left" and not model.training


def test_damaged_cached_weights_are_rebuilt(language_cache, tmp_path):
    import shutil

    shutil.copytree(language_cache / "foundation", tmp_path / "foundation")
    args = (tmp_path, SEED, PUBLIC, EPOCHS)
    path = foundation.language_foundation_path(*args, examples_per_task=SMALL)
    path.write_bytes(b"not safetensors")
    model, _ = foundation.load_language_foundation(*args, examples_per_task=SMALL)
    assert path.stat().st_size > 1000 and not model.training


# --- loading real checkpoints ----------------------------------------------------------------


def test_load_pretrained_causal_lm_from_a_saved_checkpoint(tmp_path, tokenizer):
    from transformers import LlamaForCausalLM

    model = foundation.tiny_llama(tokenizer, seed=1).eval()
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    loaded, loaded_tokenizer = foundation.load_pretrained_causal_lm(str(tmp_path / "ckpt"))
    assert isinstance(loaded, LlamaForCausalLM) and not loaded.training
    assert loaded_tokenizer.padding_side == "left"
    batch = loaded_tokenizer(["### Instruction:\nhello\n\n### Response:\n"], return_tensors="pt")
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"]).logits
        actual = loaded(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(actual, expected)


def test_load_pretrained_causal_lm_names_a_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        foundation.load_pretrained_causal_lm(str(missing))
    with pytest.raises(FileNotFoundError, match="offline-only/not-a-model"):
        foundation.load_pretrained_causal_lm("offline-only/not-a-model")


def test_the_language_foundation_is_pretrained_on_the_data_seeds_corpus() -> None:
    """Its public split must come from the corpus the clients' data are cut from: at seed 1
    with data-seed 0 (a tuned table's final run) the foundation is data seed 0's."""
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.models.causal_lm import foundation_args

    base = ExperimentConfig(dataset="instructions", backbone="tiny-llama", seed=1)
    assert foundation_args(base)["seed"] == 1
    assert foundation_args(base.replace(data_seed=0))["seed"] == 0
