"""`rapidfire report`: a finished run, or an experiment, as a picture and a few lines of text.

    rapidfire report RUN_DIR [--out PATH]

A run folder (`<run.output_dir>/<run.name>`): reads `run_summary.json` and `steps.jsonl` (every
rank's record of every step), writes a PNG (default RUN_DIR/report.png) with the loss, the
throughput and the step-time breakdown over the steps, and prints a short summary.
An experiment folder (`experiment_summary.json`, running or finished): one PNG with every
config's held-out metric and training loss per chunk over its optimizer steps (a clone's line
starts from its parent's point at the boundary it was cloned at; a stopped or failed config ends
in a cross), and the leaderboard.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import RapidfireError

TITLES = ("Loss", "Throughput (tokens/s)", "Step-time breakdown (fraction of step)")


def load_run(run_dir: str) -> tuple[dict, list[dict]]:
    """(run summary, step records) of a finished run; RapidfireError naming what is missing."""
    if not os.path.isdir(run_dir):
        raise RapidfireError(f"RUN_DIR '{run_dir}' is not a folder; pass <run.output_dir>/<run.name>, e.g. runs/tiny")
    summary_path = os.path.join(run_dir, "run_summary.json")
    steps_path = os.path.join(run_dir, "steps.jsonl")
    for path in (summary_path, steps_path):
        if not os.path.isfile(path):
            raise RapidfireError(f"RUN_DIR '{run_dir}': no {os.path.basename(path)}; the run has not finished (it is "
                                 "written at the end), or this is not a run folder")
    try:
        with open(summary_path, encoding="utf-8") as f:
            summary = json.load(f)
        with open(steps_path, encoding="utf-8") as f:
            steps = [json.loads(line) for line in f if line.strip()]
    except (ValueError, UnicodeDecodeError) as e:
        raise RapidfireError(f"RUN_DIR '{run_dir}': unreadable run files ({e})") from None
    if not isinstance(summary, dict) or not steps:
        raise RapidfireError(f"RUN_DIR '{run_dir}': the run recorded no steps")
    return summary, steps


def parts_of(steps: list[dict]) -> list[str]:
    """The step-time parts the records hold, in their order (data_wait, forward, backward,
    optimizer, communication, other): every phase but the step total."""
    return [k for k in steps[0]["phases"] if k != "step"]


def per_step(steps: list[dict]) -> list[dict]:
    """One row per step: tokens/s (all ranks' tokens over rank 0's step time, as the summary's
    tokens_per_s) and each part's fraction of step time, averaged over ranks."""
    parts = parts_of(steps)
    by_step: dict[int, list[dict]] = {}
    for r in steps:
        by_step.setdefault(r["step"], []).append(r)
    rows = []
    for step, records in sorted(by_step.items()):
        first = min(records, key=lambda r: r["rank"])
        seconds = first["phases"]["step"]
        fractions = {}
        for part in parts:
            fractions[part] = sum(r["phases"].get(part, 0.0) / (r["phases"]["step"] or 1e-12)
                                  for r in records) / len(records)
        rows.append({"step": step, "seconds": seconds, "fractions": fractions,
                     "tokens_per_s": sum(r["tokens"] for r in records) / seconds if seconds else 0.0})
    return rows


def plot_run(summary: dict, steps: list[dict]):
    """A matplotlib Figure (Agg canvas, no pyplot state) with the panels in TITLES, in order."""
    Figure, FigureCanvasAgg = _figure_classes()
    from matplotlib.ticker import MaxNLocator

    rows = per_step(steps)
    xs = [r["step"] for r in rows]
    fig = Figure(figsize=(8, 9), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, tput_ax, time_ax = fig.subplots(3, 1, sharex=True)
    history = summary.get("loss_history") or []
    loss_ax.plot([h["step"] for h in history], [h["loss"] for h in history], marker=".")
    tput_ax.plot(xs, [r["tokens_per_s"] for r in rows], marker=".", color="tab:green")
    bottom = [0.0] * len(rows)
    for part in parts_of(steps):
        heights = [r["fractions"][part] for r in rows]
        time_ax.bar(xs, heights, width=1.0, bottom=bottom, label=part.replace("_", " "), linewidth=0)
        bottom = [b + h for b, h in zip(bottom, heights)]
    time_ax.set_ylim(0, 1)
    time_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    for ax, title in zip((loss_ax, tput_ax, time_ax), TITLES):
        ax.set_title(title)
        ax.grid(alpha=0.3)
    time_ax.set_xlabel("step")
    time_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"{summary.get('stage', '?')} run: {summary.get('steps', len(rows))} steps, "
                 f"{summary.get('num_workers', '?')} worker(s)")
    return fig


def _bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KB", "MB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GB"


def describe(summary: dict, steps: list[dict]) -> list[str]:
    """The text summary: steps, loss, throughput, where the time went, memory and communication."""
    loss = summary.get("final_loss")
    first = summary.get("first_loss")
    lines = [f"steps: {summary.get('steps')} ({summary.get('stage', '?')}, {summary.get('num_workers', '?')} "
             f"worker(s)), {summary.get('samples', 0)} samples, {summary.get('tokens', 0)} tokens",
             "loss: " + (f"{first:.4f} -> {loss:.4f}" if loss is not None and first is not None else "not logged")]
    lines.append(f"throughput: {summary.get('tokens_per_s', 0):,.1f} tokens/s, padding "
                 f"{100 * summary.get('padding_fraction', 0):.1f}% of computed tokens")
    breakdown = summary.get("time_breakdown") or {}
    parts = sorted(((v, k) for k, v in breakdown.items()), reverse=True)
    lines.append("time: " + ", ".join(f"{k.replace('_', ' ')} {100 * v:.1f}%" for v, k in parts))
    memory = f"memory: peak {_bytes(summary.get('peak_memory_bytes', 0))} (the largest worker's)"
    if summary.get("oom_splits"):
        memory += f", {summary['oom_splits']} batch(es) split after running out of memory"
    lines.append(memory)
    comm = summary.get("communication") or {}
    if comm.get("bytes_sent_per_step") is not None:
        line = (f"communication ({comm.get('mode', '?')}): {_bytes(comm['bytes_sent_per_step'])} sent per step per "
                f"worker, compression {comm.get('compression_ratio') or 1:.1f}x")
        if comm.get("comm_latency_p50_s") is not None:
            line += (f", latency p50 {1e3 * comm['comm_latency_p50_s']:.1f} ms / "
                     f"p99 {1e3 * comm['comm_latency_p99_s']:.1f} ms")
        if comm.get("hidden_share") is not None:
            line += f", {100 * comm['hidden_share']:.0f}% of the exchange time hidden behind backward"
        if comm.get("skipped_steps"):
            line += f", {comm['skipped_steps']} step(s) skipped for non-finite gradients"
        lines.append(line)
    return lines


def _figure_classes():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RapidfireError("rapidfire report needs matplotlib: pip install matplotlib") from None
    return Figure, FigureCanvasAgg


def plot_experiment(summary: dict):
    """A Figure with one line per config (that trained a chunk) in each of two panels: the held-out
    metric and the training loss after each chunk, over the config's optimizer steps."""
    Figure, FigureCanvasAgg = _figure_classes()
    fig = Figure(figsize=(9, 8), layout="constrained")
    FigureCanvasAgg(fig)
    score_ax, loss_ax = fig.subplots(2, 1, sharex=True)
    by_id = {c["id"]: c for c in summary["configs"]}
    for c in summary["configs"]:
        history = c.get("history") or []
        if not history or c["state"] == "deleted":
            continue
        start = _branch_point(c, by_id)
        for ax, key in ((score_ax, "score"), (loss_ax, "train_loss")):
            xs = [h["step"] for h in history]
            ys = [h[key] for h in history]
            if start is not None:
                xs, ys = [start["step"]] + xs, [start[key]] + ys
            (line,) = ax.plot(xs, ys, marker=".", linestyle="--" if c.get("parent") else "-",
                              label=f"{c['id']} {c['values_text']}")
            if c["state"] in ("stopped", "failed"):
                ax.plot([xs[-1]], [ys[-1]], marker="x", markersize=9, color=line.get_color())
    score_ax.set_title(f"Held-out {summary['metric']} after each chunk (lower is better)")
    loss_ax.set_title("Training loss of each chunk")
    loss_ax.set_xlabel("optimizer step of the config")
    for ax in (score_ax, loss_ax):
        ax.grid(alpha=0.3)
    score_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.suptitle(f"experiment {summary['name']} ({summary['status']}, policy {summary['policy']}): "
                 f"{summary['counts']}")
    return fig


def _branch_point(config: dict, by_id: dict) -> dict | None:
    """A warm clone's parent record at the boundary the clone started from (None: cold or unknown)."""
    parent = by_id.get(config.get("warm_from") or "")
    first = (config.get("history") or [{}])[0].get("chunk")
    if parent is None or not first:
        return None
    return next((h for h in parent.get("history") or [] if h["chunk"] == first - 1), None)


def write_report(run_dir: str, out: str | None = None) -> tuple[str, list[str]]:
    """Write the PNG (default RUN_DIR/report.png); return (its path, the text summary lines)."""
    from .experiments.summary import SUMMARY, render_leaderboard

    experiment = os.path.join(run_dir, SUMMARY)
    if os.path.isfile(experiment):
        try:
            with open(experiment, encoding="utf-8") as f:
                exp_summary = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise RapidfireError(f"RUN_DIR '{run_dir}': unreadable {SUMMARY} ({e})") from None
        fig, lines = plot_experiment(exp_summary), render_leaderboard(exp_summary).splitlines()
    else:
        summary, steps = load_run(run_dir)
        fig, lines = plot_run(summary, steps), describe(summary, steps)
    out = out or os.path.join(run_dir, "report.png")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise RapidfireError(f"--out '{out}': folder {parent} does not exist")
    fig.savefig(out, dpi=100)
    return out, lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rapidfire report", description="Plot a finished run's loss, throughput and "
                                "step-time breakdown, or every config of an experiment, and summarise it.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run or experiment folder: <run.output_dir>/<run.name>")
    p.add_argument("--out", default=None, metavar="PATH", help="where to write the PNG (default RUN_DIR/report.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        path, lines = write_report(args.run_dir, args.out)
    except RapidfireError as e:
        print(f"rapidfire: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
