"""`rapidfire train` with compressed communication on 2 real Ray Train workers (gloo): the
compressed allreduce hook and rapidfire_adamw complete, learn, count their bytes, and resume."""
from __future__ import annotations

import json

import pytest
import torch

from rapidfire_ray.cli import main
from paths import SAMPLE, TINY_PROFILE


def train(out, name, *overrides, flags=(), resume=False):
    argv = ["train", "--profile", TINY_PROFILE, *flags, *(["--resume"] if resume else []), f"data.path={SAMPLE}",
            f"run.output_dir={out}", f"run.name={name}", *overrides]
    rc = main(argv)
    assert rc == 0
    return json.loads((out / name / "run_summary.json").read_text())


def test_allreduce_compressed_trains_and_sends_fewer_bytes(ray_cluster, tmp_path):
    s = train(tmp_path, "compressed", "optimizer.params.compression.grad=1bit",
              "optimizer.params.compression.keep_fp16=[]", "optimizer.params.compression.min_numel=0",
              flags=["--communication", "allreduce_compressed"])
    assert s["final_loss"] < s["first_loss"], s["loss_history"]
    comm = s["communication"]
    # Everything 1-bit: 32x fewer bytes than fp32 minus the per-chunk scales and the flag.
    assert 20 < comm["compression_ratio"] <= 32, comm
    assert comm["comm_latency_p50_s"] > 0 and comm["skipped_steps"] == 0
    assert s["time_breakdown"]["communication"] > 0
    # Each rank saved its error feedback with the checkpoint.
    ckpt = tmp_path / "compressed" / "checkpoint-00000008"
    assert sorted(p.name for p in ckpt.glob("comm_state_rank*.pt")) == ["comm_state_rank0.pt", "comm_state_rank1.pt"]


def test_rapidfire_adamw_trains_and_resumes(ray_cluster, tmp_path):
    # allreduce_compressed (the article's flag) with rapidfire_adamw: its compressed momentum exchange
    s = train(tmp_path, "onebit", "optimizer.type=rapidfire_adamw", "optimizer.params.compression.grad=1bit",
              "communication.mode=allreduce_compressed",
              "optimizer.params.freeze_step=2", "train.max_steps=4", "checkpoint.every_steps=2")
    assert s["final_loss"] < s["first_loss"], s["loss_history"]
    steps = [json.loads(line) for line in (tmp_path / "onebit" / "steps.jsonl").read_text().splitlines()]
    ratio = {r["step"]: r["compression_ratio"] for r in steps if r["rank"] == 0}
    # warm-up: fp32 gradients, plus the clip's one float all_reduce (~1e-5 of the bytes here)
    assert ratio[1] == pytest.approx(1.0, rel=1e-3) and ratio[2] == pytest.approx(1.0, rel=1e-3)
    assert ratio[1] < 1.0  # the control bytes are counted, not hidden
    assert ratio[3] > 10 and ratio[4] > 10  # then only the 1-bit momentum crosses the wire
    ckpt = tmp_path / "onebit" / "checkpoint-00000004"
    assert sorted(p.name for p in ckpt.glob("comm_state_rank*.pt")) == ["comm_state_rank0.pt", "comm_state_rank1.pt"]
    # The trainer clipped through the optimizer (train.grad_clip 1.0): both warm-up steps measured
    # how much shorter the averaged gradient is than the ranks' own, the ratio it clips with later.
    ours = torch.load(ckpt / "optimizer.pt", weights_only=True)["rapidfire_adamw"]
    assert ours["grad_norm_ratio_samples"] == 2 and 0 < ours["grad_norm_ratio_sq"] < 1
    resumed = train(tmp_path, "onebit", "optimizer.type=rapidfire_adamw", "optimizer.params.compression.grad=1bit",
                    "communication.mode=allreduce_compressed", "optimizer.params.freeze_step=2", "train.max_steps=6", "checkpoint.every_steps=2", resume=True)
    assert resumed["start_step"] == 4 and resumed["steps"] == 6


def test_auto_measures_the_link_decides_per_bucket_and_reports_it(ray_cluster, tmp_path):
    s = train(tmp_path, "auto", "optimizer.params.compression.grad=auto", "optimizer.params.compression.auto_interval=3",
              "train.max_steps=4", "checkpoint.every_steps=0", flags=["--communication", "allreduce_compressed"])
    auto = s["communication"]["auto"]
    # measured when training starts and again 3 steps later, on both workers' gloo group
    assert [m["step"] for m in auto["measurements"]] == [0, 3]
    assert all(m["world_size"] == 2 and m["link"]["allreduce_bytes_s"] > 0 for m in auto["measurements"])
    assert auto["decisions"] and all(d["step"] == 3 and d["codec"] in ("none", "fp16", "1bit", "2bit")
                                     and d["codec"] == min(d["predicted_s"], key=d["predicted_s"].get)
                                     for d in auto["decisions"])
    steps = [json.loads(line) for line in (tmp_path / "auto" / "steps.jsonl").read_text().splitlines()]
    by_rank = {r: {rec["step"]: rec for rec in steps if rec["rank"] == r} for r in (0, 1)}
    # the step records carry each measurement and the decisions it led to; both ranks made the same
    for step in (1, 4):
        assert "auto_measurement" in by_rank[0][step] and "auto_measurement" in by_rank[1][step]
        assert by_rank[0][step]["auto_decisions"] == by_rank[1][step]["auto_decisions"]
    assert "auto_measurement" not in by_rank[0][2] and "auto_decisions" not in by_rank[0][2]
    assert s["final_loss"] < s["first_loss"], s["loss_history"]
