"""Memory levels end to end on the shared Ray cluster: real Ray Train workers, real TRL, real
DeepSpeed ZeRO-3 on gloo."""
from __future__ import annotations

import json

import pytest
import torch

import rapidfire_ray
from paths import TINY_PROFILE as TINY
from rapidfire_ray.models import model_num_parameters


def run(tmp_path, name: str, **overrides) -> dict:
    # fp32 pinned: train.precision auto picks bf16 on a CPU with AMX, and the byte counts below are
    # fp32's (the precision policy has its own tests)
    return rapidfire_ray.train(TINY, overrides={"run.output_dir": str(tmp_path), "run.name": name,
                                                "train.max_steps": 4, "checkpoint.every_steps": 0,
                                                "train.precision": "fp32", **overrides})


@pytest.fixture(scope="module")
def level0(ray_cluster, tmp_path_factory):
    return run(tmp_path_factory.mktemp("level0"), "l0", **{"memory.optim_level": "level0"})


def test_level0_counts_saved_activations_and_changes_nothing(level0):
    mem = level0["memory"]
    assert mem["level"] == "level0" and mem["checkpointed_layers"] == [] and mem["precision"]["compute"] == "fp32"
    assert mem["saved_activation_bytes"] == mem["saved_activation_raw_bytes"] > 0
    params = model_num_parameters("tiny-random")
    # DDP: every worker holds all parameters and both AdamW moments (and a step counter per tensor).
    for held in mem["held_bytes_per_worker"]:
        assert held["parameters"] == 4 * params and 8 * params <= held["optimizer_state"] < 8 * params + 1024


def test_level2_compresses_saved_activations_and_checkpoints_what_the_budget_needs(level0, tmp_path):
    # A budget nothing fits in: every block is checkpointed (and the run still trains).
    s = run(tmp_path, "l2", **{"memory.optim_level": "level2", "data.dynamic_batch.memory_threshold": 1e-9})
    mem = s["memory"]
    assert mem["level"] == "level2" and mem["options"]["act"] == "int8" and mem["options"]["defragment"]
    assert mem["checkpointed_layers"] == [0, 1] and "over budget" in mem["checkpoint_plan"]
    assert mem["saved_activation_bytes"] < 0.5 * level0["memory"]["saved_activation_bytes"]
    assert s["final_loss"] < s["first_loss"]
    on_disk = json.loads((tmp_path / "l2" / "run_summary.json").read_text())
    assert on_disk["memory"] == mem and mem["peak_memory_bytes"] == s["peak_memory_bytes"] > 0
    assert abs(s["final_loss"] - level0["final_loss"]) / level0["final_loss"] < 0.01, (s["loss_history"],
                                                                                       level0["loss_history"])


def test_level3_shards_parameters_and_optimizer_state_with_deepspeed(level0, tmp_path):
    s = run(tmp_path, "l3", **{"memory.optim_level": "level3"})
    mem = s["memory"]
    assert mem["level"] == "level3" and mem["options"]["zero_stage"] == 3
    assert s["final_loss"] < s["first_loss"]
    replicated = level0["memory"]["held_bytes_per_worker"][0]
    for held in mem["held_bytes_per_worker"]:
        assert held["fp32_master"] == 0  # the CPU fix: no second fp32 copy of the partitions
        share = (held["parameters"] + held["optimizer_state"]) / (replicated["parameters"]
                                                                   + replicated["optimizer_state"])
        assert 0.45 < share <= 0.55, (held, replicated)
    # The final model is whole (gathered from the shards) and loads like any other.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(s["model_dir"])
    assert sum(p.numel() for p in model.parameters()) == model_num_parameters("tiny-random")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not any(p.name.startswith("global_step") for p in (tmp_path / "l3" / "model").iterdir())

    # Resumed under another precision: DeepSpeed would look for bf16_zero_pp_rank_* files; one line instead.
    from rapidfire_ray.errors import RunFailed

    with pytest.raises(RunFailed, match="train.precision: checkpoint checkpoint-00000004 holds ZeRO-3 optimizer "
                                        "partitions saved under fp32 or fp16"):
        rapidfire_ray.train(TINY, resume=True, overrides={
            "run.output_dir": str(tmp_path), "run.name": "l3", "train.max_steps": 6, "checkpoint.every_steps": 0,
            "memory.optim_level": "level3", "train.precision": "bf16"})

    # Resume from the ZeRO-3 checkpoint (each worker's partitions, merged by Ray Train).
    resumed = rapidfire_ray.train(TINY, resume=True, overrides={
        "run.output_dir": str(tmp_path), "run.name": "l3", "train.max_steps": 6, "checkpoint.every_steps": 0,
        "memory.optim_level": "level3", "train.precision": "fp32"})
    assert resumed["start_step"] == 4 and [h["step"] for h in resumed["loss_history"]] == [5, 6]
    assert resumed["final_loss"] < s["first_loss"]

