"""RL config keys, prompt rows and reward-model checks: one-line errors, no Ray needed."""
from __future__ import annotations

import json

import pytest

from rapidfire_ray.config import load_config
from rapidfire_ray.data.formats import normalise
from rapidfire_ray.data.prompts import row_columns
from rapidfire_ray.errors import RapidfireError

RL = {"train.stage": "rl", "data.format": "prompt", "model.name": "tiny-random"}


def test_defaults_and_stage_rl_accepted():
    cfg = load_config(None, RL)
    assert cfg.rl.algorithm == "grpo" and cfg.rl.reward.num_actors == 1 and cfg.rl.reward.functions == ["answer_match"]
    assert cfg.rl.ppo.value_init == "auto"
    for algorithm in ("rloo", "ppo"):
        assert load_config(None, {**RL, "rl.algorithm": algorithm}).rl.algorithm == algorithm


@pytest.mark.parametrize("overrides, match", [
    ({"data.format": "prompt_completion"}, r"data.format: 'prompt_completion' cannot feed train.stage rl"),
    ({"train.stage": "sft"}, r"data.format: 'prompt' rows .* only feed train.stage rl"),
    ({"rl.algorithm": "dpo"}, r"rl.algorithm: 'dpo' is not one of: grpo, rloo, ppo"),
    ({"rl.reward.functions": ["length"]}, r"rl.reward.functions: unknown reward function 'length'"),
    ({"rl.reward.functions": []}, r"rl.reward: no reward"),
    ({"rl.reward.weights": {"modle": 2.0}}, r"rl.reward.weights: 'modle' names no reward"),
    ({"train.per_device_batch_size": 6}, r"train.per_device_batch_size: 6 .* not a multiple of rl.num_generations 4"),
    ({"rl.num_generations": 1, "train.per_device_batch_size": 4}, r"rl.num_generations: grpo .* at least 2"),
    ({"rl.max_new_tokens": 510}, r"rl.max_new_tokens: 510 leaves 2 tokens"),
    ({"rl.algorithm": "ppo", "rl.ppo.minibatch_size": 3}, r"rl.ppo.minibatch_size: 3 does not divide"),
    ({"rl.algorithm": "ppo", "rl.ppo.value_init": "reward"}, r"rl.ppo.value_init: 'reward' needs rl.reward.model"),
    ({"rl.ppo.gamma": 1.5}, r"rl.ppo.gamma: 1.5 is out of range"),
    ({"rl.algorithm": "ppo", "communication.mode": "allreduce_compressed", "optimizer.params.compression.grad": "1bit"},
     r"communication.mode allreduce_compressed: not with train.stage rl \(ppo\): ppo's update loop"),
    ({"communication.mode": "parameter_server"}, r"communication.mode parameter_server: not with train.stage rl"),
    ({"memory.optim_level": "level1"}, r"memory.optim_level level1: not with train.stage rl \(grpo\)"),
    ({"data.dynamic_batch.strategy": "token_budget"}, r"data.dynamic_batch.strategy token_budget: not with"),
])
def test_bad_rl_config_is_one_line(overrides, match):
    with pytest.raises(RapidfireError, match=match) as e:
        load_config(None, {**RL, **overrides})
    assert "\n" not in str(e.value)


def test_grpo_and_rloo_take_the_compressed_exchange_and_rapidfire_adamw():
    for algorithm in ("grpo", "rloo"):
        cfg = load_config(None, {**RL, "rl.algorithm": algorithm, "communication.mode": "allreduce_compressed",
                                 "optimizer.params.compression.grad": "1bit"})
        assert cfg.communication.mode == "allreduce_compressed"
        cfg = load_config(None, {**RL, "rl.algorithm": algorithm, "optimizer.type": "rapidfire_adamw",
                                 "optimizer.params.compression.grad": "1bit"})
        assert cfg.optimizer.type == "rapidfire_adamw"


def test_prompt_rows():
    good = normalise({"prompt": "What is 2+2?", "answer": "4", "id": 7}, "prompt")
    assert good["error"] == "" and good["prompt"] == "What is 2+2?"
    assert row_columns(good) == {"prompt": "What is 2+2?", "answer": "4", "id": 7}
    chat = normalise({"prompt": [{"role": "user", "content": "Hi"}], "answer": "x"}, "prompt")
    assert chat["error"] == "" and row_columns(chat)["prompt"] == [{"role": "user", "content": "Hi"}]
    assert normalise({"answer": "4"}, "prompt")["error"] == "missing field 'prompt'"
    assert normalise({"prompt": "   "}, "prompt")["error"] == "empty text in 'prompt'"
    assert "ends with an assistant message" in normalise(
        {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}, "prompt")["error"]
    assert "expected one of" in normalise({"prompt": [{"role": "bot", "content": "Hi"}]}, "prompt")["error"]


def test_reward_model_checks(tmp_path, tiny_reward_model):
    from transformers import AutoConfig

    from rapidfire_ray.models import load_model, load_tokenizer
    from rapidfire_ray.rl.reward_pool import check_reward_model, same_vocabulary

    tokenizer = check_reward_model(tiny_reward_model)
    assert same_vocabulary(tokenizer, load_tokenizer("tiny-random"))
    with pytest.raises(RapidfireError, match=r"rl.reward.model: '.*' is not a model directory"):
        check_reward_model(str(tmp_path))
    causal = tmp_path / "causal"
    load_model("tiny-random").save_pretrained(causal)
    load_tokenizer("tiny-random").save_pretrained(causal)
    with pytest.raises(RapidfireError, match=r"holds LlamaForCausalLM, not a sequence-classification model"):
        check_reward_model(str(causal))
    # no pad token anywhere: the classifier cannot find each row's last token
    nopad = tmp_path / "nopad"
    import shutil

    shutil.copytree(tiny_reward_model, nopad)
    config = AutoConfig.from_pretrained(nopad)
    config.pad_token_id = None
    config.save_pretrained(nopad)
    tk = json.loads((nopad / "tokenizer_config.json").read_text())
    tk.pop("pad_token", None)
    (nopad / "tokenizer_config.json").write_text(json.dumps(tk))
    with pytest.raises(RapidfireError, match=r"has no pad token and its config no pad_token_id"):
        check_reward_model(str(nopad))


def test_missing_reward_model_required_or_optional(tmp_path):
    from rapidfire_ray.rl.spec import resolve_reward_model

    missing = str(tmp_path / "runs" / "reward" / "model")
    with pytest.raises(RapidfireError, match=r"rl.reward.model: '.*' does not exist; train a reward model first"):
        resolve_reward_model(load_config(None, {**RL, "rl.reward.model": missing}))
    assert resolve_reward_model(load_config(None, {**RL, "rl.reward.model": missing,
                                                   "rl.reward.model_required": False})) is None
    with pytest.raises(RapidfireError, match=r"nothing would score the rollouts"):
        resolve_reward_model(load_config(None, {**RL, "rl.reward.model": missing, "rl.reward.model_required": False,
                                                "rl.reward.functions": []}))


@pytest.mark.parametrize("name", ["rl_grpo", "rl_rloo", "rl_ppo"])
def test_profiles_load(name):
    from paths import REPO

    cfg = load_config(f"{REPO}/jobs/configs/{name}.yaml")
    assert cfg.train.stage == "rl" and cfg.rl.algorithm == name[3:] and cfg.data.format == "prompt"
    assert cfg.rl.reward.model == "runs/reward/model" and cfg.rl.reward.model_required is False
