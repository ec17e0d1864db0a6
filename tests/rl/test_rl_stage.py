"""The RL stage end to end on real Ray actors: GRPO, RLOO and PPO on 2 tiny-random workers
with a reward-model actor (a tiny-random sequence classifier) plus the answer_match rule, and a
reward actor that dies inside a scoring call: the run completes and every rollout is scored."""
from __future__ import annotations

import json
import math
import os
import threading
import time

import pytest

from paths import SAMPLE

ROWS = 16


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    """16 prompt rows of the sample task (prompt + answer), plus an empty prompt and an overlong one."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with open(SAMPLE, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][:ROWS]
    rows = [{"id": r["id"], "prompt": r["prompt"], "answer": r["answer"]} for r in rows if len(r["prompt"]) < 140]
    rows.append({"id": "empty", "prompt": "  ", "answer": "1"})
    rows.append({"id": "long", "prompt": "x" * 400, "answer": "1"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _config(tmp_path, prompts: str, reward_model: str, algorithm: str, **extra):
    from rapidfire_ray.config import load_config

    overrides = {"model.name": "tiny-random", "train.stage": "rl", "data.format": "prompt", "data.path": prompts,
                 "data.max_length": 160, "rl.algorithm": algorithm, "rl.max_new_tokens": 6,
                 "rl.num_generations": 2, "train.per_device_batch_size": 4, "train.max_steps": 2,
                 "rl.reward.model": reward_model, "rl.reward.batch_size": 3, "optimizer.params.lr": 1e-4,
                 "run.output_dir": str(tmp_path / "runs"), "run.name": f"rl-{algorithm}", "scaling.num_workers": 2}
    overrides.update(extra)
    return load_config(None, overrides)


def _check_run(summary: dict, tmp_path, algorithm: str) -> None:
    from transformers import AutoModelForCausalLM

    rl, pool = summary["rl"], summary["reward_pool"]
    assert summary["stage"] == "rl" and rl["algorithm"] == algorithm and summary["steps"] == 2
    assert len(rl["reward_history"]) == 2
    for h in rl["reward_history"]:
        assert math.isfinite(h["reward"]) and math.isfinite(h["reward_model"]) and 0.0 <= h["answer_match"] <= 1.0
    # Every completion generated was scored by the pool (2 steps x 2 workers x 4 completions).
    assert pool["generated"] == 16 and pool["scored"] == 16 and pool["unscored"] == 0
    for phase in ("rollout", "reward", "update"):
        assert rl["time_breakdown"][phase] > 0 and rl["seconds_per_step"][phase] > 0
    assert rl["rollout_tokens_per_s"] > 0 and rl["generated_tokens"] > 0
    assert summary["data"]["bad_rows"] == 2 and summary["data"]["overlong_prompts"] == 1
    model_dir = os.path.join(tmp_path, "runs", f"rl-{algorithm}", "model")
    assert summary["model_dir"] == model_dir
    AutoModelForCausalLM.from_pretrained(model_dir)  # the trained policy loads
    steps = [json.loads(line) for line in open(os.path.join(tmp_path, "runs", f"rl-{algorithm}", "steps.jsonl"))]
    assert {(r["rank"], r["step"]) for r in steps} == {(0, 1), (1, 1), (0, 2), (1, 2)}


def test_grpo_with_reward_actor_that_dies_mid_run(ray_cluster, tmp_path, prompts, tiny_reward_model):
    """GRPO: the reward actor exits inside its first training-time scoring call; Ray restarts it,
    the pool scores that batch again; the run completes with every rollout scored."""
    import ray

    from rapidfire_ray.driver import run
    from rapidfire_ray.rl.reward_pool import actor_name

    cfg = _config(tmp_path, prompts, tiny_reward_model, "grpo", **{"rl.eval_path": prompts, "rl.eval_max_prompts": 2})
    injected = threading.Event()

    def inject():
        deadline = time.time() + 600
        while time.time() < deadline and not injected.is_set():
            try:
                actor = ray.get_actor(actor_name(cfg.run.name, 0))
                ray.get(actor.crash_after.remote(2))  # call 1: the held-out evaluation
                injected.set()
            except ValueError:  # not started yet
                time.sleep(0.5)

    thread = threading.Thread(target=inject, daemon=True)
    thread.start()
    summary = run(cfg)
    thread.join(timeout=5)
    assert injected.is_set()
    _check_run(summary, tmp_path, "grpo")
    pool = summary["reward_pool"]
    assert pool["retries"] >= 1  # the lost batch was submitted again ...
    assert pool["unscored"] == 0  # ... and nothing went unscored
    assert pool["actors"][0]["restarted"] is True  # by Ray, after the crash
    ev = summary["rl"]["eval"]
    assert ev["before"]["prompts"] == 2 and 0.0 <= ev["after"]["task_score"] <= 1.0
    assert math.isfinite(ev["after"]["mean_reward"])


def test_rloo_with_reward_actor_over_the_compressed_exchange(ray_cluster, tmp_path, prompts, tiny_reward_model):
    """RLOO through the same gradient exchange as SFT: 1-bit compressed allreduce with error
    feedback (bytes counted in every step record), the NaN guard counting skipped steps."""
    from rapidfire_ray.driver import run

    summary = run(_config(tmp_path, prompts, tiny_reward_model, "rloo", **{
        "rl.reward.weights": {"model": 0.5}, "communication.mode": "allreduce_compressed",
        "optimizer.params.compression.grad": "1bit", "optimizer.params.compression.keep_fp16": [],
        "optimizer.params.compression.min_numel": 0}))
    _check_run(summary, tmp_path, "rloo")
    assert summary["rl"]["reward_weights"] == {"model": 0.5}
    comm = summary["communication"]
    assert comm["mode"] == "allreduce_compressed" and comm["compression_ratio"] > 10, comm
    assert comm["skipped_steps"] == 0 and summary["nonfinite_skipped_steps"] == 0


def test_ppo_with_reward_actor_and_value_model_from_it(ray_cluster, tmp_path, prompts, tiny_reward_model):
    from rapidfire_ray.driver import run

    summary = run(_config(tmp_path, prompts, tiny_reward_model, "ppo", **{"rl.ppo.epochs": 2,
                                                                          "rl.ppo.minibatch_size": 2}))
    _check_run(summary, tmp_path, "ppo")
    rl = summary["rl"]
    assert rl["value_init"] == "reward"
    for h in rl["reward_history"]:
        for key in ("kl", "policy_loss", "value_loss", "clip_fraction", "approx_kl"):
            assert math.isfinite(h[key]), key
        assert 0.0 <= h["clip_fraction"] <= 1.0


def test_pool_scores_again_a_batch_whose_actor_died(ray_cluster, tiny_reward_model):
    """The reward pool on its own: the actor exits inside a call; the batch is scored again after
    Ray restarts it, and the scores equal those of an undisturbed pass."""
    import ray

    from rapidfire_ray.config import load_config
    from rapidfire_ray.rl.reward_pool import RewardPool, kill_actors, launch_reward_actors

    cfg = load_config(None, {"train.stage": "rl", "data.format": "prompt", "run.name": "pool-fault",
                             "rl.reward.model": tiny_reward_model, "rl.reward.cpus_per_actor": 0.5})
    actors = launch_reward_actors(cfg, tiny_reward_model)
    try:
        pool = RewardPool(actors, ["answer_match"], {"model": 2.0}, batch_size=2)
        prompts = [f"What is {i} + 1? " for i in range(5)] + [[{"role": "user", "content": "Say 3."}]]
        completions = [str(i + 1) for i in range(5)] + ["3"]
        rows = [{"answer": str(i + 1)} for i in range(5)] + [{"answer": "3"}]
        totals, parts = pool.score(prompts, completions, rows)
        assert parts["answer_match"] == [1.0] * 6
        assert totals == pytest.approx([2.0 * m + 1.0 for m in parts["model"]])
        ray.get(actors[0].crash_after.remote(2))  # the second of the next three batches dies with the actor
        again = pool.score_model(prompts, completions)
        assert again == pytest.approx(parts["model"], abs=1e-5)
        assert pool.retries >= 1 and pool.take()["reward_scored"] == 12
        assert ray.get(actors[0].stats.remote())["restarted"] is True
    finally:
        kill_actors(actors)
