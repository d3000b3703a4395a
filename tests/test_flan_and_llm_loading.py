"""FedDPA's Flan files (``fedfm_flower.data.flan``) and loading a causal LM in a chosen dtype,
device map or 4-bit (run-config keys ``model-dtype``, ``device-map``, ``load-in-4bit``)."""

from __future__ import annotations

import json
import tomllib
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data.flan import flan_client_split, flan_client_task, flan_num_clients
from fedfm_flower.data.instructions import Example
from fedfm_flower.methods.settings import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _config(run_config: dict) -> ExperimentConfig:
    return ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **run_config})


def _record(i: int, category: str | None = None, **extra: object) -> dict:
    record = {"instruction": f"Question {i}?", "output": f"answer {i}", **extra}
    if category is not None:
        record["category"] = category
    return record


def _write_list(path: Path, records: list) -> None:
    path.write_text(json.dumps(records))


def _write_lines(path: Path, records: list) -> None:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")


@pytest.fixture
def flan_dir(tmp_path: Path) -> Path:
    """Two clients: a JSON list with categories, JSON lines without; both test file names."""
    data = tmp_path / "dataset1" / "2"
    data.mkdir(parents=True)
    _write_list(
        data / "local_training_0.json",
        [_record(i, "paraphrase", input=f"context {i}") for i in range(3)],
    )
    _write_lines(data / "local_training_1.json", [_record(i) for i in range(10, 14)])
    _write_list(data / "local_test_0.json", [_record(100, "paraphrase")])
    _write_lines(data / "local_testing_1.json", [_record(200), _record(201)])
    return data


# --- the Flan files ---------------------------------------------------------------------------


def test_flan_files_give_each_client_its_splits_and_task(flan_dir: Path) -> None:
    data_dir = str(flan_dir)
    assert flan_num_clients(data_dir) == 2
    assert flan_client_task(data_dir, 0) == "paraphrase"
    assert flan_client_task(data_dir, 1) == "client-1"  # no category in its records
    train, test = flan_client_split(data_dir, 0, 2)
    assert train[1] == Example("paraphrase", "Question 1?", "context 1", "answer 1")
    assert test == (Example("paraphrase", "Question 100?", "", "answer 100"),)
    train, test = flan_client_split(data_dir, 1, 2)
    assert [e.output for e in train] == [f"answer {i}" for i in range(10, 14)]
    assert {e.task for e in train + test} == {"client-1"}
    assert [e.instruction for e in test] == ["Question 200?", "Question 201?"]


def test_a_client_task_is_its_most_common_category_and_examples_keep_their_own(
    tmp_path: Path,
) -> None:
    records = [_record(0, "sentiment"), _record(1, "trec"), _record(2, "trec"), _record(3)]
    _write_lines(tmp_path / "local_training_0.jsonl", records)
    _write_list(tmp_path / "local_test_0.json", [_record(9, task="trec")])  # "task" works too
    assert flan_client_task(str(tmp_path), 0) == "trec"
    train, test = flan_client_split(str(tmp_path), 0, 1)
    assert [e.task for e in train] == ["sentiment", "trec", "trec", "trec"]
    assert test[0].task == "trec"


def test_the_authors_pooled_test_file_serves_clients_without_their_own(tmp_path: Path) -> None:
    data = tmp_path / "dataset1" / "2"
    data.mkdir(parents=True)
    _write_list(data / "local_training_0.json", [_record(0, "paraphrase")])
    _write_list(data / "local_training_1.json", [_record(1, "trec")])
    pooled = [_record(10, "trec"), _record(11, "paraphrase"), _record(12, "trec")]
    _write_lines(tmp_path / "dataset1" / "flan_test_200_selected_nstrict_1.jsonl", pooled)
    assert [e.output for e in flan_client_split(str(data), 1, 2)[1]] == ["answer 10", "answer 12"]
    assert [e.output for e in flan_client_split(str(data), 0, 2)[1]] == ["answer 11"]
    _write_list(data / "local_training_0.json", [_record(0, "wic")])
    with pytest.raises(ValueError, match=r"no record of client 0's task 'wic'.*paraphrase, trec"):
        flan_client_split(str(data), 0, 2)


def test_flan_errors_name_the_bad_value(flan_dir: Path, tmp_path: Path) -> None:
    data_dir = str(flan_dir)
    missing = tmp_path / "no-such-dir"
    with pytest.raises(FileNotFoundError, match="'data-dir' = .*no-such-dir.*no such directory"):
        flan_client_split(str(missing), 0, 2)
    with pytest.raises(ValueError, match="'data-dir' = '' is invalid for dataset 'flan'"):
        flan_num_clients("")
    with pytest.raises(ValueError, match="3 clients .* has 2 client training files"):
        flan_client_split(data_dir, 0, 3)
    with pytest.raises(ValueError, match=r"partition_id 2 is not in \[0, 2\)"):
        flan_client_task(data_dir, 2)

    (flan_dir / "local_testing_1.json").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=r"missing local_test_1.json or local_testing_1.json for client 1 .* has 2 clients",
    ):
        flan_client_split(data_dir, 1, 2)

    _write_list(flan_dir / "local_training_3.json", [_record(0)])
    with pytest.raises(
        FileNotFoundError,
        match=r"missing local_training_2.json for client 2 .* has 3 client training files "
        r"\(indices 0-1, 3\)",
    ):
        flan_num_clients(data_dir)
    (flan_dir / "local_training_3.json").unlink()

    _write_list(flan_dir / "local_training_0.json", [_record(0), {"instruction": "Why?"}])
    with pytest.raises(ValueError, match=r"record 1 of .*local_training_0.json has no 'output'"):
        flan_client_split(data_dir, 0, 2)
    _write_lines(flan_dir / "local_test_0.json", [{"input": "x", "output": "y"}])
    _write_list(flan_dir / "local_training_0.json", [_record(0)])
    with pytest.raises(ValueError, match=r"record 0 of .*local_test_0.json has no 'instruction'"):
        flan_client_split(data_dir, 0, 2)
    (flan_dir / "local_test_0.json").write_text('{"instruction": "a", "output": "b"}\n{oops\n')
    with pytest.raises(ValueError, match=r"line 2 of .*local_test_0.json is not valid JSON"):
        flan_client_split(data_dir, 0, 2)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no client training files in .*empty"):
        flan_num_clients(str(empty))


def test_a_hub_id_groups_records_into_clients_by_task(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from fedfm_flower.data import flan

    def rows(tasks: list[str]) -> datasets.Dataset:
        return datasets.Dataset.from_dict(
            {
                "instruction": [f"q{i}" for i in range(len(tasks))],
                "output": [f"a{i}" for i in range(len(tasks))],
                "task": tasks,
            }
        )

    loaded = datasets.DatasetDict(
        {"train": rows(["wic", "cola", "wic"]), "test": rows(["cola", "wic"])}
    )
    monkeypatch.setattr(datasets, "load_dataset", lambda name: loaded)
    flan._hub_clients.cache_clear()
    try:
        assert flan_num_clients("someone/flan-federated") == 2
        assert [flan_client_task("someone/flan-federated", i) for i in (0, 1)] == ["cola", "wic"]
        train, test = flan_client_split("someone/flan-federated", 1, 2)
        assert [e.instruction for e in train] == ["q0", "q2"] and test[0].output == "a1"
        with pytest.raises(ValueError, match="data-dir 'someone/flan-federated' has 2 tasks"):
            flan_client_split("someone/flan-federated", 0, 8)
    finally:
        flan._hub_clients.cache_clear()


def test_an_uncached_hub_id_fails_naming_the_local_cache() -> None:
    from fedfm_flower.data import flan

    flan._hub_clients.cache_clear()
    with pytest.raises(FileNotFoundError, match="must be in the local Hugging Face cache"):
        flan_num_clients("offline-only/not-a-flan-dataset")


def test_flan_is_registered_and_configured(tmp_path: Path) -> None:
    from fedfm_flower.data.registry import dataset_spec

    assert dataset_spec("flan").task == "instruction-following"
    config = {"dataset": "flan", "backbone": "hf-causal-lm"}
    assert _config({**config, "data-dir": "someone/flan-federated"}).data_dir  # a Hub id
    assert _config({**config, "data-dir": str(tmp_path)}).dataset == "flan"
    for path in ("./not-here", "data/dataset1/8", "/data/8"):  # paths, not Hub ids
        with pytest.raises(ConfigError, match=f"'data-dir' = '{path}' is invalid: no such dir"):
            _config({**config, "data-dir": path})


# --- loading a causal LM ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaMA (float32) and its tokenizer saved by ``save_pretrained``."""
    from fedfm_flower.data.instructions import build_corpus
    from fedfm_flower.models.language.foundation import tiny_llama
    from fedfm_flower.models.language.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(build_corpus(0, examples_per_task=20).examples())
    path = tmp_path_factory.mktemp("checkpoint") / "llama"
    tiny_llama(tokenizer, seed=5).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def hf_config(small_run_config: dict, checkpoint: Path) -> dict:
    return {
        **small_run_config,
        "dataset": "instructions",
        "backbone": "hf-causal-lm",
        "model-name-or-path": str(checkpoint),
        "lora-target-modules": "q_proj,v_proj",
        "num-clients": 2,
    }


def test_the_flan_task_reads_its_clients_through_the_instruction_task(
    hf_config: dict, flan_dir: Path
) -> None:
    from fedfm_flower.tasks.instructions import InstructionFollowing

    config = _config({**hf_config, "dataset": "flan", "data-dir": str(flan_dir)})
    task = InstructionFollowing()
    counts = task.example_counts(config, 2)
    assert [(c.train, c.test) for c in counts] == [(3, 1), (4, 2)]
    data = task.client_data(config, 0, 2)
    assert data.task == "paraphrase" and len(data.train) == 3
    assert data.test.examples[0].output == "answer 100"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_dtype_sets_the_backbone_dtype_and_adapters_stay_float32(
    hf_config: dict, dtype: torch.dtype
) -> None:
    from fedfm_flower.models import build_model, initial_trainable

    config = _config({**hf_config, "model-dtype": str(dtype).removeprefix("torch.")})
    model = build_model(config, "lora")
    assert model.lm.model.embed_tokens.weight.dtype == dtype
    assert {p.dtype for n, p in model.lm.named_parameters() if "lora_" not in n} == {dtype}
    trainable = model.trainable().tensors
    assert trainable and {t.dtype for t in trainable.values()} == {torch.float32}
    assert not model.placed
    # The server's initial adapter (a skeleton, no weights loaded) equals the clients' one.
    initial = initial_trainable(config, "lora", 0).tensors
    assert all(torch.equal(initial[n], t) for n, t in trainable.items())
    batch = model.tokenizer(["### Instruction:\nhi\n\n### Response:\n"], return_tensors="pt")
    labels = batch["input_ids"].clone()
    loss = model(batch["input_ids"], batch["attention_mask"], labels).loss
    loss.backward()  # peft casts the half-precision activations to the float32 adapters
    assert all(p.grad is not None for p in model.group_parameters(["adapter"]).values())


def test_model_dtype_auto_is_float32_on_the_cpu(hf_config: dict, checkpoint: Path) -> None:
    from fedfm_flower.models.causal_lm import load_dtype
    from fedfm_flower.models.language.foundation import load_pretrained_causal_lm

    assert load_dtype(_config({**hf_config, "device": "cpu"})) == "float32"
    if not torch.cuda.is_available():
        assert load_dtype(_config(hf_config)) == "float32"
    model, _ = load_pretrained_causal_lm(str(checkpoint), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_device_map_auto_places_the_model_or_names_the_missing_accelerate(
    hf_config: dict,
) -> None:
    from fedfm_flower.models.build import ModelCache

    run_config = {**hf_config, "device-map": "auto"}
    if find_spec("accelerate") is None:
        with pytest.raises(ConfigError, match="'device-map' = 'auto'.*accelerate"):
            _config(run_config)
        return
    config = _config(run_config)
    model = ModelCache().get(config, "lora", 0, torch.device("cpu"))
    assert model.placed  # ModelCache leaves it where accelerate put it
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert next(model.lm.parameters()).device.type == expected
    with pytest.raises(ConfigError, match="'device-map' = 'auto'.*device 'cpu'"):
        _config({**run_config, "device": "cpu"})


def test_load_in_4bit_without_bitsandbytes_or_cuda_fails_naming_the_key(
    hf_config: dict, checkpoint: Path
) -> None:
    from fedfm_flower.models import build_model
    from fedfm_flower.models.language.foundation import load_pretrained_causal_lm

    with pytest.raises(ConfigError, match="'load-in-4bit' = True is invalid: needs a CUDA GPU"):
        _config({**hf_config, "load-in-4bit": True, "device": "cpu"})
    if find_spec("bitsandbytes") is None:
        with pytest.raises(ConfigError, match="'load-in-4bit' = True .* bitsandbytes is not"):
            _config({**hf_config, "load-in-4bit": True})
    elif not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="'load-in-4bit' = True .* torch sees none"):
            build_model(_config({**hf_config, "load-in-4bit": True}), "lora")
    if find_spec("bitsandbytes") is None or not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="'load-in-4bit' = True is invalid"):
            load_pretrained_causal_lm(str(checkpoint), load_in_4bit=True)


def test_bad_loading_values_fail_config_parsing_naming_the_key(hf_config: dict) -> None:
    with pytest.raises(ConfigError, match="'model-dtype' = 'float64' is invalid: allowed: auto"):
        _config({**hf_config, "model-dtype": "float64"})
    with pytest.raises(ConfigError, match="'device-map' = 'balanced' is invalid"):
        _config({**hf_config, "device-map": "balanced"})
    with pytest.raises(ConfigError, match="'model-dtype' = 'bfloat16' .* 'hf-causal-lm' only"):
        _config({**hf_config, "backbone": "tiny-llama", "model-dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="'load-in-4bit' = True .* 'hf-causal-lm' only"):
        _config({"load-in-4bit": True})


def test_pyproject_declares_the_new_keys_with_their_defaults() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    keys = declared["config"]
    assert (keys["model-dtype"], keys["device-map"], keys["load-in-4bit"]) == ("auto", "", False)
    defaults = ExperimentConfig().to_run_config()
    assert all(defaults[k] == keys[k] for k in ("model-dtype", "device-map", "load-in-4bit"))
    names = list(keys)
    assert names.index("model-dtype") == names.index("model-name-or-path") + 1
