"""The instruction-following task on the tiny LLaMA: loss, batching, ROUGE evaluation, and a
federated run end to end (FedIT: FedAvg of LoRA) through the real ServerApp and ClientApp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import record_names

LANGUAGE = {
    "dataset": "instructions",
    "backbone": "tiny-llama",
    "lora-target-modules": "q_proj,v_proj",
    "lora-rank": 4,
    "lora-alpha": 8.0,
    "optimizer": "adamw",
    "lr": 0.003,
    "batch-size": 16,
    "pretrain-epochs": 2,
    "max-new-tokens": 8,
}


@pytest.fixture
def language_config(small_run_config: dict) -> dict:
    """Two clients (two instruction tasks), one round of two local steps."""
    return {
        **small_run_config,
        **LANGUAGE,
        "num-clients": 2,
        "num-server-rounds": 1,
        "local-steps": 2,
    }


def _config(run_config: dict) -> ExperimentConfig:
    return ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **run_config})


def test_step_is_the_response_cross_entropy_and_batches_are_trimmed(language_config) -> None:
    from fedfm_flower.models import build_model
    from fedfm_flower.tasks.instructions import InstructionFollowing

    config = _config(language_config)
    task = InstructionFollowing()
    data = task.client_data(config, 0, 2)
    model = build_model(config, "lora")
    input_ids, attention_mask, labels = next(task.batches(data.train, 4, None))
    assert attention_mask[:, -1].any() and input_ids.shape[1] <= config.max_length
    step = task.step(model, (input_ids, attention_mask, labels))
    # independent computation: next-token cross-entropy on the response tokens only
    logits = model(input_ids, attention_mask).logits[:, :-1]
    target = labels[:, 1:]
    keep = target != -100
    manual = torch.nn.functional.cross_entropy(logits[keep], target[keep])
    torch.testing.assert_close(step.loss, manual)
    assert step.count == 4
    prompt_positions = (labels == -100) & (attention_mask == 1)
    assert prompt_positions.any(axis=1).all()  # the prompt carries no loss


def test_evaluation_reports_rouge_as_the_primary_metric(language_config) -> None:
    from fedfm_flower.models import build_model
    from fedfm_flower.tasks.instructions import InstructionFollowing

    config = _config(language_config)
    task = InstructionFollowing()
    data = task.client_data(config, 1, 2)
    stats = task.evaluate(build_model(config, "lora"), data.test, torch.device("cpu"), 256)
    assert task.primary_metric == "rouge-1"  # FedDPA's headline
    assert set(stats.metrics) == {"rouge-1", "rouge-2", "rouge-l"}
    assert all(0.0 <= v <= 1.0 for v in stats.metrics.values())
    assert stats.num_examples == len(data.test.examples) and stats.loss > 0


def test_fedit_runs_end_to_end_and_only_the_adapter_travels(language_config) -> None:
    from fedfm_flower.models import MODEL_CACHE, backbone_fingerprint, build_model
    from server_apps.inprocess import run_in_process

    config = {**language_config, "method": "fedavg"}
    summary, grid = run_in_process(config, 2)
    assert summary["primary-metric"] == "rouge-1"
    assert set(summary["final-per-client-rouge-1"]) == {"0", "1"}
    run_dir = Path(config["output-dir"]) / summary["run-name"]
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert {"test-rouge-l-mean", "test-rouge-1-mean", "test-rouge-2-std"} <= set(record)
    for client, metrics in record["evaluate"].items():
        assert 0.0 <= metrics[P.test_metric("rouge-l")] <= 1.0, client
    for message in grid.sent:
        arrays = message.content.array_records.get(P.ARRAYS)
        if message.metadata.message_type == "train":
            assert arrays and all(".lora_" in k for k in record_names(arrays))
    saved = json.loads((run_dir / "config.json").read_text())
    assert {"rouge-l", "seconds"} <= set(saved["foundation"]) or saved["foundation"]
    fresh = build_model(_config(config), "lora")
    assert backbone_fingerprint(MODEL_CACHE._model.lm) == backbone_fingerprint(fresh.lm)


def test_a_local_llama_checkpoint_loads_through_the_causal_lm_family(
    language_config, tmp_path: Path
) -> None:
    from fedfm_flower.models import build_model, initial_trainable
    from fedfm_flower.models.causal_lm import tokenizer_of
    from fedfm_flower.models.language.foundation import tiny_llama

    config = _config(language_config)
    tokenizer = tokenizer_of(config)
    saved = tiny_llama(tokenizer, seed=5)
    saved.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    hf = config.replace(backbone="hf-causal-lm", model_name_or_path=str(tmp_path / "llama"))
    model = build_model(hf, "lora")
    assert torch.equal(model.lm.model.embed_tokens.weight, saved.model.embed_tokens.weight)
    assert set(model.trainable().groups.values()) == {"adapter"}
    # The server's initial adapter (no weights loaded) equals the clients' seeded one.
    initial = initial_trainable(hf, "lora", 0).tensors
    assert all(torch.equal(initial[n], t) for n, t in model.trainable().tensors.items())
    with pytest.raises(ValueError, match="model-name-or-path"):
        build_model(config.replace(backbone="hf-causal-lm"), "lora")
