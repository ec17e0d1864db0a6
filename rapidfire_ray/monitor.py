"""`rapidfire monitor`: a live terminal view of a running run, and its knobs.

    rapidfire monitor [--address ADDR] [--run NAME] [--metrics comm_latency,throughput,...]
                      [--interval S] [--once] [--json] [--adjust_parameters auto|off] [--set KNOB=VALUE]

It joins the run's Ray cluster (`--address`, else $RAY_ADDRESS, else the local one) and finds the
run by its control actor (`rapidfire-control-<run.name>`, namespace `rapidfire`), which hands it
the progress board: the same per-step records the driver prints and `run_summary.json` is made
of, every worker's newest one. Reading those (rather than scraping Prometheus) needs no metrics
pipeline, works the moment a step is done (Ray exports metrics seconds later), shows exactly
the numbers the run summary will hold, and goes through the same actor the knobs live on.
Exit codes: 0 done (the run ended or Ctrl-C), 1 no running run, 2 usage error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

GROUPS = {
    "loss": ("loss", "learning_rate"),
    "throughput": ("tokens_per_s", "step_s"),
    "step_time": ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "communication_s"),
    "data_wait": ("data_wait_s", "data_wait_fraction"),
    "comm_latency": ("comm_latency_p50_s", "comm_latency_p99_s"),
    "bytes": ("bytes_sent", "bytes_received"),
    "compression": ("compression_ratio",),
    "staleness": ("ps_staleness",),
    "batch": ("batch_rows", "padding_fraction"),
    "memory": ("peak_memory_bytes",),
    "knobs": ("knobs",),
}
RECENT_STEPS = 10  # a worker's tokens/s and step time: mean over its newest steps


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rapidfire monitor", description="Watch a running run's metrics and knobs.")
    p.add_argument("--address", default=None, help="Ray cluster of the run (ip:port or auto; default: $RAY_ADDRESS, "
                                                   "else the local cluster)")
    p.add_argument("--run", default=None, metavar="NAME", help="run.name to watch (default: the only running run)")
    p.add_argument("--metrics", default=None, metavar="LIST",
                   help=f"comma-separated groups to show: {', '.join(GROUPS)} (default: all)")
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print snapshots as JSON objects (one per line)")
    p.add_argument("--adjust_parameters", "--adjust-parameters", choices=("auto", "off"), default=None,
                   help="switch the run's rules on (auto) or to watching only (off)")
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                   help="change a live knob by hand (also to set it back), e.g. data.prefetch_depth=3")
    return p


class NoRun(Exception):
    pass


def _connect(address: str | None) -> None:
    # A token-auth cluster (Ray 2.60's default) needs RAY_AUTH_MODE before Ray is imported.
    token = os.environ.get("RAY_AUTH_TOKEN") or (Path(os.environ.get("RAY_AUTH_TOKEN_PATH")
                                                      or Path.home() / ".ray" / "auth_token").exists())
    if token and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
    except Exception as e:
        raise NoRun(f"no Ray cluster at '{address}' ({str(e).splitlines()[0][:160]}); pass --address of the "
                    "run's cluster (ip:port) or start a run with rapidfire train") from None


def find_control(run: str | None):
    """The control actor of `run`, or of the only running run."""
    import ray

    from .telemetry.control import NAMESPACE, PREFIX

    names = sorted(a["name"][len(PREFIX):] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a.get("namespace") == NAMESPACE and a["name"].startswith(PREFIX))
    if run is None:
        if not names:
            raise NoRun("no running rapidfire run on this Ray cluster; start one with rapidfire train "
                        "(or pass --address of the cluster it runs on)")
        if len(names) > 1:
            raise NoRun(f"{len(names)} runs are running ({', '.join(names)}); choose one with --run NAME")
        run = names[0]
    elif run not in names:
        raise NoRun(f"run '{run}' is not running on this Ray cluster"
                    + (f" (running: {', '.join(names)})" if names else "") + "; check --run and --address")
    from .telemetry.control import control_name

    return run, ray.get_actor(control_name(run), namespace=NAMESPACE)


def _worker_view(record: dict, recent: list[dict]) -> dict:
    mine = [r for r in recent if r["rank"] == record["rank"]][-RECENT_STEPS:] or [record]
    wall = sum(r["phases"]["step"] for r in mine)
    ph = record["phases"]
    padded = record.get("padded_tokens") or 0
    return {
        "rank": record["rank"], "step": record["step"],
        "tokens_per_s": sum(r["tokens"] for r in mine) / wall if wall > 0 else 0.0,
        "step_s": wall / len(mine),
        "data_wait_s": ph.get("data_wait"), "forward_s": ph.get("forward"), "backward_s": ph.get("backward"),
        "optimizer_s": ph.get("optimizer"), "communication_s": ph.get("communication"),
        "data_wait_fraction": (ph.get("data_wait", 0.0) / ph["step"]) if ph.get("step") else 0.0,
        "comm_latency_p50_s": record.get("comm_latency_p50_s"), "comm_latency_p99_s": record.get("comm_latency_p99_s"),
        "bytes_sent": record.get("bytes_sent"), "bytes_received": record.get("bytes_received"),
        "compression_ratio": record.get("compression_ratio"), "ps_staleness": record.get("ps_staleness"),
        "batch_rows": record.get("samples"),
        "padding_fraction": (padded - record.get("tokens", 0)) / padded if padded else 0.0,
        "peak_memory_bytes": record.get("peak_memory_bytes"), "knobs": record.get("knobs"),
    }


def snapshot(control, run: str, groups: list[str] | None = None) -> dict:
    """One view of the run: run-level numbers, every worker's newest step, knobs and changes."""
    import ray

    info = ray.get(control.info.remote(), timeout=30)
    latest = ray.get(info["board"].latest.remote(), timeout=30)
    keep = set(k for g in (groups or GROUPS) for k in GROUPS[g]) | {"rank", "step"}
    workers = [{k: v for k, v in _worker_view(r, latest["recent"]).items() if k in keep} for r in latest["workers"]]
    log = latest["log"] or {}
    out = {
        "run": run, "time": time.time(),
        "step": min((w["step"] for w in workers), default=None),
        "total_steps": latest["plan"]["total_steps"],
        "tokens_per_s": sum(w.get("tokens_per_s", 0.0) for w in workers) if "tokens_per_s" in keep else None,
        "loss": log.get("loss"), "learning_rate": log.get("learning_rate"),
        "workers": workers,
        "adjust": info["adjust"], "allowed": info["allowed"], "knobs": info["knobs"],
        "changes": [{k: c[k] for k in ("step", "knob", "old", "new", "reason", "source", "applied_step")}
                    for c in info["changes"]],
        "advice": [{k: a[k] for k in ("step", "knob", "reason")} for a in info["advice"]],
    }
    if groups is not None and "loss" not in groups:
        out.pop("loss"), out.pop("learning_rate")
    return out


def _fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if key.endswith("bytes") or key.startswith("bytes_"):
        return f"{value / 2**20:.1f}M" if value >= 2**20 else f"{value / 1024:.1f}K"
    if key in ("comm_latency_p50_s", "comm_latency_p99_s"):
        return f"{value * 1000:.1f}ms"
    if key.endswith("_fraction"):
        return f"{value:.1%}"
    if key == "knobs":
        return ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def render(snap: dict) -> str:
    head = [f"run {snap['run']}", f"step {snap['step']}/{snap['total_steps'] or '?'}"]
    if snap.get("loss") is not None:
        head.append(f"loss {snap['loss']:.4f}")
    if snap.get("learning_rate") is not None:
        head.append(f"lr {snap['learning_rate']:.2e}")
    if snap.get("tokens_per_s") is not None:
        head.append(f"{snap['tokens_per_s']:.1f} tok/s")
    head.append(f"adjust {snap['adjust']}")
    lines = [" | ".join(head)]
    if snap["workers"]:
        keys = list(snap["workers"][0])
        rows = [keys] + [[_fmt(k, w.get(k)) for k in keys] for w in snap["workers"]]
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(keys))]
        lines += ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in rows]
    else:
        lines.append("(no step finished yet)")
    lines.append("knobs: " + ", ".join(f"{k}={v}" for k, v in snap["knobs"].items()))
    for c in snap["changes"][-5:]:
        lines.append(f"change after step {c['step']}: {c['knob']} {c['old']} -> {c['new']} ({c['source']}: "
                     f"{c['reason']})")
    for a in snap["advice"][-3:]:
        lines.append(f"advice at step {a['step']}: {a['reason']}")
    return "\n".join(lines)


def _parse_set(items: list[str]) -> list[tuple[str, object]]:
    import yaml

    out = []
    for item in items:
        knob, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set '{item}': expected KNOB=VALUE, e.g. data.prefetch_depth=3")
        out.append((knob.strip(), yaml.safe_load(raw) if raw.strip() else None))
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    groups = None
    if args.metrics:
        groups = [g.strip() for g in args.metrics.split(",") if g.strip()]
        unknown = [g for g in groups if g not in GROUPS]
        if unknown:
            print(f"rapidfire: error: --metrics: unknown {', '.join(unknown)}; choose from {', '.join(GROUPS)}",
                  file=sys.stderr)
            return 2
    try:
        changes = _parse_set(args.set)
    except ValueError as e:
        print(f"rapidfire: error: {e}", file=sys.stderr)
        return 2
    try:
        _connect(args.address)
        run, control = find_control(args.run)
    except NoRun as e:
        print(f"rapidfire: {e}", file=sys.stderr)
        return 1
    import ray

    try:
        if args.adjust_parameters:
            ray.get(control.set_mode.remote(args.adjust_parameters))
            print(f"[rapidfire] run {run}: adjust {args.adjust_parameters}", file=sys.stderr)
        for knob, value in changes:
            try:
                c = ray.get(control.set_knob.remote(knob, value))
            except ray.exceptions.RayTaskError as e:
                print(f"rapidfire: error: --set {knob}: {str(e.cause) if e.cause else e}", file=sys.stderr)
                return 2
            print(f"[rapidfire] run {run}: {knob} {c['old']} -> {c['new']} after step {c['step']}", file=sys.stderr)
        while True:
            snap = snapshot(control, run, groups)
            if args.json:
                print(json.dumps(snap), flush=True)
            else:
                if sys.stdout.isatty() and not args.once:
                    print("\x1b[H\x1b[2J", end="")
                print(render(snap), flush=True)
            if args.once:
                return 0
            time.sleep(args.interval)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        print(f"[rapidfire] run {run} ended", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
