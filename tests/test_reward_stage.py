"""train.stage reward end to end on the shared Ray cluster: real Ray Train workers (2), real gloo,
TRL's RewardTrainer, the held-out evaluation, and the exported model loaded as a sequence
classifier."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

import rapidfire_ray
from rapidfire_ray.config import load_config
from rapidfire_ray.errors import RapidfireError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = os.path.join(REPO, "jobs", "configs", "reward.yaml")
WORDS = "apple river stone cloud garden window silver orange planet forest candle bridge market".split()


def separable_pairs(n: int, seed: int) -> list[dict]:
    """Pairs a tiny model can learn in a few steps: the chosen answer is "yes", the rejected "no"."""
    rng = random.Random(seed)
    return [{"prompt": f"Is {' '.join(rng.sample(WORDS, 3))} fine? ", "chosen": "yes", "rejected": "no"}
            for _ in range(n)]


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tiny(tmp_path, **overrides) -> dict:
    return {"model.name": "tiny-random", "run.output_dir": str(tmp_path), "data.max_length": 64,
            "train.per_device_batch_size": 8, "train.lr_scheduler": "constant", "optimizer.params.lr": 3e-3,
            "train.warmup_steps": 0, "train.log_every_steps": 2, "checkpoint.every_steps": 0, **overrides}


@pytest.fixture(scope="module")
def reward_run(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward")
    train = write(tmp / "train.jsonl", separable_pairs(64, seed=0))
    heldout = write(tmp / "heldout.jsonl", separable_pairs(40, seed=1))
    summary = rapidfire_ray.train(REWARD, overrides=tiny(tmp, **{
        "data.path": train, "data.eval_path": heldout, "run.name": "r", "train.max_steps": 24}))
    return summary, tmp / "r", train


def test_reward_stage_completes_and_learns_its_training_pairs(reward_run):
    s, run_dir, _ = reward_run
    assert s["stage"] == "reward" and s["steps"] == 24 and s["num_workers"] == 2
    assert s["samples"] == 24 * 8 * 2  # pairs: steps x per-device pairs x workers
    assert s["data"]["rows"] == 64 and s["final_loss"] < s["first_loss"]
    r = s["reward_eval"]
    assert r["train_accuracy_tail_mean"] > 0.5, r  # above chance on the pairs it trained on
    assert r["train_accuracy_tail_mean"] > r["train_accuracy_first"] or r["train_accuracy_first"] == 1.0
    assert json.loads((run_dir / "run_summary.json").read_text())["reward_eval"] == r


def test_held_out_accuracy_and_margin_in_the_summary(reward_run):
    s, _, _ = reward_run
    r = s["reward_eval"]
    assert r["pairs"] == 40 and r["eval_bad_pairs_skipped"] == 0
    assert r["accuracy"] >= 0.9 and r["margin_mean"] > 0, r


def test_exported_model_loads_as_a_sequence_classifier_and_scores_text(reward_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rapidfire_ray.data.preference import PreferenceTokenizer
    from rapidfire_ray.stages.reward_eval import score_pairs

    s, run_dir, train = reward_run
    model_dir = run_dir / "model"
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    assert not (model_dir / "optimizer.pt").exists()
    texts = ["Is apple river stone fine? yes" + tok.eos_token, "Is apple river stone fine? no" + tok.eos_token]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        scores = model(**batch).logits.squeeze(-1)
    assert scores.shape == (2,) and scores[0] > scores[1]
    # the training pairs, scored by the exported model
    pair_tok = PreferenceTokenizer("tiny-random", 64)
    rows = [json.loads(line) for line in open(train)]
    pairs = [dict(zip(("chosen_ids", "rejected_ids"), pair_tok.pair(r["prompt"], r["chosen"], r["rejected"], "")))
             for r in rows]
    assert score_pairs(model, pairs, tok.pad_token_id)["accuracy"] >= 0.9


def test_compressed_allreduce_with_token_budget_batches(ray_cluster, tmp_path):
    """1-bit compressed gradients and token-budget batches of pairs (no held-out file)."""
    train = write(tmp_path / "train.jsonl", separable_pairs(48, seed=2))
    s = rapidfire_ray.train(REWARD, overrides=tiny(tmp_path, **{
        "data.path": train, "data.eval_path": None, "run.name": "c", "train.max_steps": 4,
        "communication.mode": "allreduce_compressed", "optimizer.params.compression.grad": "1bit",
        "optimizer.params.compression.min_numel": 0, "optimizer.params.compression.keep_fp16": [],
        "data.dynamic_batch.strategy": "token_budget", "data.dynamic_batch.max_tokens": 256}))
    assert s["steps"] == 4 and s["communication"]["mode"] == "allreduce_compressed"
    assert s["communication"]["compression_ratio"] > 4
    assert s["reward_eval"]["pairs"] == 0 and s["reward_eval"]["accuracy"] is None
    # every batch within the budget: a pair takes 2 rows of its longer side's width
    steps = [json.loads(line) for line in open(tmp_path / "c" / "steps.jsonl")]
    assert all(r["padded_tokens"] <= 256 for r in steps) and all(r["samples"] >= 1 for r in steps)


# ----- config -------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"data.format": "prompt_completion"}, "data.format: 'prompt_completion' cannot feed train.stage reward"),
    ({"train.stage": "sft"}, "data.format: 'preference' pairs only feed train.stage reward"),
    ({"train.stage": "sft", "data.format": "prompt_completion"}, "data.eval_path: only used by train.stage reward"),
    ({"data.eval_path": " "}, "data.eval_path: ' ' is empty"),
    ({"data.dynamic_batch.strategy": "token_budget", "data.dynamic_batch.max_tokens": 200},
     "data.dynamic_batch.max_tokens: 200 cannot hold one preference pair"),
])
def test_config_refusals(overrides, message):
    with pytest.raises(RapidfireError) as e:
        load_config(REWARD, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_reward_profile_loads():
    cfg = load_config(REWARD)
    assert cfg.train.stage == "reward" and cfg.model.name == "smollm2-135m" and cfg.data.format == "preference"
    assert os.path.isfile(os.path.join(REPO, cfg.data.path)) and os.path.isfile(os.path.join(REPO, cfg.data.eval_path))
