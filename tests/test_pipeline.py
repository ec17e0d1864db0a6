"""`train.stage: pipeline` (jobs/configs/pipeline.yaml with tiny-random and a few steps): SFT ->
reward -> RL end to end on real Ray Train workers and a real reward actor; an interruption in the
reward stage (an injected crash after its first checkpoint) and `--resume` continuing there;
bad pipeline configs failing before any stage starts."""
from __future__ import annotations

import json
import os

import pytest

from rapidfire_ray.cli import main
from paths import REPO

pytestmark = pytest.mark.timeout(900)

PROFILE = os.path.join(REPO, "jobs", "configs", "pipeline.yaml")
TINY = ["model.name=tiny-random", "train.max_steps=3", "checkpoint.every_steps=0",
        "pipeline.reward.train.max_steps=4", "pipeline.reward.checkpoint.every_steps=2",
        "pipeline.reward.train.log_every_steps=1", "pipeline.reward.data.max_length=96",
        "pipeline.rl.train.max_steps=2", "pipeline.rl.train.per_device_batch_size=4",
        "pipeline.rl.rl.num_generations=2", "pipeline.rl.rl.max_new_tokens=6",
        "pipeline.rl.rl.eval_max_prompts=4", "pipeline.rl.data.max_length=96"]


def pipeline(out, *extra, resume=False):
    return main(["train", "--profile", PROFILE, *(["--resume"] if resume else []), f"run.output_dir={out}",
                 "run.name=pipe", *TINY, *extra])


def test_pipeline_runs_three_stages_and_resumes_at_the_interrupted_one(ray_cluster, tmp_path, monkeypatch, capsys):
    root = tmp_path / "pipe"
    monkeypatch.setenv("RAPIDFIRE_INJECT_CRASH", "reward:3")  # after the reward stage's step-2 checkpoint
    assert pipeline(tmp_path) == 1
    assert json.loads((root / "sft" / "run_summary.json").read_text())["status"] == "completed"
    # the failed stage leaves its summary too (status failed), and the pipeline's resume command
    failed = json.loads((root / "reward" / "run_summary.json").read_text())
    assert failed["status"] == "failed" and failed["last_checkpoint"].endswith("checkpoint-00000002"), failed
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("rapidfire: training failed: ") and last.endswith(" run.name=pipe " + " ".join(TINY)
                                                                               + " --resume"), last
    assert not (root / "rl").exists()
    monkeypatch.delenv("RAPIDFIRE_INJECT_CRASH")

    capsys.readouterr()
    assert pipeline(tmp_path) == 2  # output there and no --resume: refused, nothing touched
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rapidfire")]
    assert len(err) == 1 and "--resume" in err[0] and "pipe" in err[0], err

    sft_before = (root / "sft" / "run_summary.json").read_text()
    assert pipeline(tmp_path, resume=True) == 0
    out = capsys.readouterr().out
    assert "stage 1/3 sft: done earlier" in out
    assert (root / "sft" / "run_summary.json").read_text() == sft_before  # not trained again
    reward = json.loads((root / "reward" / "run_summary.json").read_text())
    assert reward["start_step"] == 2 and reward["steps"] == 4  # continued from its checkpoint
    assert reward["stage"] == "reward" and reward["reward_eval"]["pairs"] > 0
    rl = json.loads((root / "rl" / "run_summary.json").read_text())
    assert rl["stage"] == "rl" and rl["steps"] == 2
    # Each stage started from the previous one's output.
    assert rl["rl"]["reward_model"] == str(root / "reward" / "model")
    s = json.loads((root / "pipeline_summary.json").read_text())
    assert s["stages"] == ["sft", "reward", "rl"]
    assert s["results"]["reward"]["reward_eval"]["accuracy"] is not None
    cmp = s["comparison"]
    assert cmp["prompts"] == 4
    for side in ("sft_model", "rl_model"):
        assert 0.0 <= cmp[side]["task_score"] <= 1.0 and cmp[side]["mean_reward"] is not None


@pytest.mark.parametrize("extra, expected", [
    (["pipeline.stages=[rl, sft]"], "pipeline.stages"),
    (["pipeline.stages=[sft, sft]"], "pipeline.stages"),
    (["pipeline.rl.rl.algorithm=dpo"], "pipeline.rl: rl.algorithm"),
    (["pipeline.reward.data.format=prompt_completion"], "pipeline.reward: data.format"),
])
def test_bad_pipeline_config_fails_before_any_stage(tmp_path, capsys, extra, expected):
    assert pipeline(tmp_path, *extra) == 2
    # Only our own lines: a Ray cluster left running by an earlier test may still print its workers' logs.
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rapidfire")]
    assert len(err) == 1 and err[0].startswith("rapidfire: error: ") and expected in err[0], err
    assert not (tmp_path / "pipe").exists()
