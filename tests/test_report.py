"""`rapidfire report`: the PNG and the text summary of a run folder (fixture: a real 3-step tiny run)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402

from rapidfire_ray import report  # noqa: E402
from rapidfire_ray.errors import RapidfireError  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "report_run")


@pytest.fixture
def run_dir(tmp_path):
    out = tmp_path / "tiny"
    shutil.copytree(FIXTURE, out)
    return str(out)


def test_report_writes_png_with_panels_and_summary(run_dir, capsys):
    assert report.main([run_dir]) == 0
    png = os.path.join(run_dir, "report.png")
    with Image.open(png) as img:
        img.verify()
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size == (800, 900)
    text = capsys.readouterr().out
    assert "steps: 3 (sft, 2 worker(s))" in text
    assert "loss: 5.6060 -> 5.0723" in text
    assert "8,921.7 tokens/s" in text
    assert "time: forward 42.6%, data wait 28.6%" in text
    assert "latency p50 3.2 ms / p99 15.6 ms" in text
    assert f"report: {png}" in text

    summary, steps = report.load_run(run_dir)
    fig = report.plot_run(summary, steps)
    loss_ax, tput_ax, time_ax = fig.axes[:3]
    assert [ax.get_title() for ax in (loss_ax, tput_ax, time_ax)] == list(report.TITLES)
    assert list(loss_ax.lines[0].get_ydata()) == [5.605968, 5.360286, 5.072276]
    # throughput per step: both ranks' tokens over rank 0's step seconds
    first = [r for r in steps if r["step"] == 1]
    assert tput_ax.lines[0].get_ydata()[0] == pytest.approx((698 + 752) / first[0]["phases"]["step"])
    labels = [t.get_text() for t in time_ax.get_legend().get_texts()]
    assert labels == ["data wait", "forward", "backward", "optimizer", "communication", "other"]
    tops = [max(p.get_y() + p.get_height() for p in time_ax.patches if p.get_x() < s - 0.4 < p.get_x() + 1)
            for s in (1, 2, 3)]
    assert tops == pytest.approx([1.0, 1.0, 1.0], abs=1e-3)  # the parts add up to the step


def test_report_out_path(run_dir, tmp_path):
    out = str(tmp_path / "elsewhere.png")
    path, lines = report.write_report(run_dir, out)
    assert path == out and os.path.getsize(out) > 10_000
    assert lines[0].startswith("steps: 3")


@pytest.mark.parametrize("breakage, message", [
    ("no_dir", "is not a folder"),
    ("no_summary", "no run_summary.json; the run has not finished"),
    ("no_steps", "no steps.jsonl"),
    ("bad_json", "unreadable run files"),
    ("empty_steps", "recorded no steps"),
])
def test_report_incomplete_run_dir(run_dir, breakage, message, capsys):
    if breakage == "no_dir":
        run_dir = os.path.join(run_dir, "missing")
    elif breakage == "no_summary":
        os.remove(os.path.join(run_dir, "run_summary.json"))
    elif breakage == "no_steps":
        os.remove(os.path.join(run_dir, "steps.jsonl"))
    elif breakage == "bad_json":
        with open(os.path.join(run_dir, "run_summary.json"), "w") as f:
            f.write('{"steps": 3,')
    else:
        open(os.path.join(run_dir, "steps.jsonl"), "w").close()
    with pytest.raises(RapidfireError, match=message):
        report.load_run(run_dir)
    assert report.main([run_dir]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rapidfire: error: ") and err.count("\n") == 1


def test_report_without_communication_section(run_dir):
    path = os.path.join(run_dir, "run_summary.json")
    with open(path) as f:
        summary = json.load(f)
    summary["communication"] = {"mode": "parameter_server"}
    _, steps = report.load_run(run_dir)
    lines = report.describe(summary, steps)
    assert not any(line.startswith("communication") for line in lines)


def test_the_rapidfire_command_dispatches_report(tmp_path, capsys):
    from rapidfire_ray.cli import main

    assert main(["report", str(tmp_path / "no-such-run")]) == 2
    assert capsys.readouterr().err.strip().startswith("rapidfire: error:")


def _config(cid, state, history, parent=None, warm_from=None):
    return {"id": cid, "values": {}, "values_text": f"lr={cid}", "state": state, "chunks_done": len(history),
            "score": history[-1]["score"] if history else None, "reason": None, "error": None, "parent": parent,
            "warm_from": warm_from, "history": history}


def _chunk(chunk, step, score):
    return {"chunk": chunk, "step": step, "score": score, "train_loss": score + 0.1}


def test_report_of_an_experiment_draws_every_config_and_prints_the_leaderboard(tmp_path, capsys):
    configs = [_config("c0", "stopped", [_chunk(1, 2, 3.0)]),
               _config("c1", "done", [_chunk(1, 2, 2.0), _chunk(2, 4, 1.5)]),
               _config("c2", "done", [_chunk(2, 4, 1.2)], parent="c1", warm_from="c1"),
               _config("c3", "failed", [])]
    summary = {"name": "exp", "status": "completed", "policy": "pbt", "metric": "eval_loss", "num_chunks": 2,
               "counts": "2 done, 1 failed, 1 stopped", "configs": configs, "swap": {}}
    fig = report.plot_experiment(summary)
    score_ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in score_ax.get_lines() if not ln.get_label().startswith("_")}
    assert set(lines) == {"c0 lr=c0", "c1 lr=c1", "c2 lr=c2"}  # c3 trained no chunk
    # the warm clone's line starts at its parent's point after chunk 1 and is dashed
    assert list(lines["c2 lr=c2"].get_xdata()) == [2, 4] and list(lines["c2 lr=c2"].get_ydata()) == [2.0, 1.2]
    assert lines["c2 lr=c2"].get_linestyle() == "--" and lines["c1 lr=c1"].get_linestyle() == "-"
    assert sum(1 for ln in score_ax.get_lines() if ln.get_marker() == "x") == 1  # c0 stopped
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "experiment_summary.json").write_text(json.dumps(summary))
    assert report.main([str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "experiment exp (completed, policy pbt): 2 done, 1 failed, 1 stopped"
    assert f"report: {folder / 'report.png'}" in out
    with Image.open(folder / "report.png") as img:
        assert img.format == "PNG" and img.size == (900, 800)
    (folder / "experiment_summary.json").write_text("{not json")
    assert report.main([str(folder)]) == 2
    assert "unreadable experiment_summary.json" in capsys.readouterr().err
