"""End to end on the shared Ray cluster: real Ray Train workers, real gloo, real TRL SFTTrainer."""
from __future__ import annotations

import json
import math
import os

import pytest

import rapidfire_ray
from rapidfire_ray.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "jobs", "configs", "tiny.yaml")
QUICKSTART = os.path.join(REPO, "jobs", "configs", "quickstart.yaml")


@pytest.fixture(scope="module")
def tiny_run(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    rc = main(["train", "--profile", TINY, f"run.output_dir={out}", "run.name=t"])
    return rc, out / "t"


def test_cli_run_trains_checkpoints_and_summarises(tiny_run):
    rc, run_dir = tiny_run
    assert rc == 0
    s = json.loads((run_dir / "run_summary.json").read_text())
    assert s["stage"] == "sft" and s["steps"] == 8 and s["num_workers"] == 2
    assert s["samples"] == 8 * 8 * 2  # steps x per-device batch x workers
    assert s["tokens"] > s["samples"] and s["tokens_per_s"] > 0
    assert 0 < s["padding_fraction"] < 1  # variable-length rows padded to the longest in the batch
    assert s["final_loss"] < s["first_loss"], s["loss_history"]  # it learns
    assert [h["step"] for h in s["loss_history"]] == list(range(1, 9))
    fractions = s["time_breakdown"]
    assert set(fractions) == {"data_wait", "forward", "backward", "optimizer", "communication", "other"}
    assert math.isclose(sum(fractions.values()), 1.0, abs_tol=0.01)
    assert fractions["forward"] > 0 and fractions["backward"] > 0 and fractions["optimizer"] > 0
    assert fractions["communication"] > 0  # two workers: gradients went through gloo all-reduce
    assert s["peak_memory_bytes"] > 50 * 2**20
    comm = s["communication"]  # plain fp32 allreduce: bytes counted where they are sent, no compression
    assert comm["compression_ratio"] == 1.0 and comm["bytes_sent_per_step"] > 4 * 90_000 * 0.9
    assert comm["skipped_steps"] == 0 and s["oom_splits"] == 0
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-00000004", "checkpoint-00000008"]
    assert not list(run_dir.parent.glob("**/*.tmp-*"))


def test_final_model_loads_in_hugging_face_format(tiny_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_dir = tiny_run
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    tok = AutoTokenizer.from_pretrained(run_dir / "model")
    assert model.config.num_hidden_layers == 2 and tok.pad_token is not None
    assert not (run_dir / "model" / "optimizer.pt").exists()


def test_rerun_without_resume_refuses_to_overwrite(tiny_run, capsys):
    _, run_dir = tiny_run
    before = sorted(p.name for p in run_dir.iterdir())
    rc = main(["train", "--profile", TINY, f"run.output_dir={run_dir.parent}", "run.name=t"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "already has checkpoints" in err and "--resume" in err and "\n" not in err
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_resume_continues_from_the_checkpoint_step(tiny_run):
    _, run_dir = tiny_run
    s = rapidfire_ray.train(TINY, resume=True, run={"output_dir": str(run_dir.parent), "name": "t"},
                            train={"max_steps": 12})
    assert s["start_step"] == 8 and s["steps"] == 12
    assert [h["step"] for h in s["loss_history"]] == [9, 10, 11, 12]
    assert s["samples"] == 4 * 8 * 2
    # Loss continues from where it was, not from a fresh model's loss.
    first = json.loads((run_dir / "run_summary.json").read_text())
    assert first["steps"] == 12
    state = json.loads((run_dir / "checkpoint-00000012" / "trainer_state.json").read_text())
    assert state["global_step"] == 12


def test_resume_without_checkpoint_and_missing_data_are_one_line_errors(ray_cluster, tmp_path, capsys):
    rc = main(["train", "--profile", TINY, f"run.output_dir={tmp_path}", "--resume"])
    assert rc == 2 and "no checkpoint of run 'tiny'" in capsys.readouterr().err
    rc = main(["train", "--profile", TINY, f"run.output_dir={tmp_path}", f"data.path={tmp_path}/nope.jsonl"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "data.path" in err and "does not exist" in err and "\n" not in err


@pytest.mark.slow
def test_smollm2_trains_one_step_offline(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    s = rapidfire_ray.train(QUICKSTART, run={"output_dir": str(tmp_path)}, train={"max_steps": 1,
                            "per_device_batch_size": 2}, data={"max_length": 64}, scaling={"num_workers": 1},
                            checkpoint={"every_steps": 0})
    assert s["steps"] == 1 and math.isfinite(s["final_loss"]) and 0 < s["final_loss"] < 20


def test_bad_model_name_fails_before_ray_with_exit_2(tmp_path, capsys):
    (tmp_path / "not-a-model").mkdir()
    rc = main(["train", "--profile", TINY, f"run.output_dir={tmp_path}", f"model.name={tmp_path}/not-a-model"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "model.name" in err and "config.json" in err and "\n" not in err


def test_a_failing_run_exits_1_and_writes_a_failed_summary(ray_cluster, tmp_path, capsys):
    """A model directory whose weights are corrupt: the tokenizer loads, the workers fail. The
    last line says what failed on which rank; the summary says `status: failed`, no step, no
    checkpoint (so there is nothing to resume)."""
    import torch

    from rapidfire_ray.models import load_model, load_tokenizer, save_pretrained_atomic

    model_dir = save_pretrained_atomic(load_model("tiny-random", torch.float32), load_tokenizer("tiny-random"),
                                       str(tmp_path / "broken"))
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not safetensors")
    rc = main(["train", "--profile", TINY, f"run.output_dir={tmp_path}", f"model.name={model_dir}",
               "train.max_steps=2"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1 and err.startswith("rapidfire: training failed: rank "), err
    assert err.endswith("no checkpoint was saved, so nothing to resume: run the same command again to start over"), err
    summary = json.loads((tmp_path / "tiny" / "run_summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] in err and summary["model_dir"] is None
    assert summary["steps_trained"] == 0 and summary["last_checkpoint"] is None


def test_token_budget_run_trains_with_little_padding(ray_cluster, tmp_path):
    s = rapidfire_ray.train(TINY, run={"output_dir": str(tmp_path), "name": "tb"}, train={"max_steps": 4},
                            checkpoint={"every_steps": 0},
                            data={"dynamic_batch": {"strategy": "token_budget", "max_tokens": 1024}})
    assert s["steps"] == 4 and s["final_loss"] < s["first_loss"]
    assert s["padding_fraction"] <= 0.05  # max_padding's default
    steps = [json.loads(line) for line in (tmp_path / "tb" / "steps.jsonl").read_text().splitlines()]
    assert all(r["padded_tokens"] <= 1024 for r in steps)  # one micro-batch per step: the budget holds
