"""experiment_summary.json (rewritten at every chunk boundary) and the leaderboard printed from it."""
from __future__ import annotations

from omegaconf import OmegaConf

from .scheduler import DELETED
from .spec import short_values

SUMMARY = "experiment_summary.json"


def summary_of(run, status: str, wall_s: float | None = None, error: str | None = None) -> dict:
    spec = run.exp.spec
    configs = []
    for cid, entry in run.sched.configs.items():
        cand, history = run.cands[cid], run.history[cid]
        configs.append({"id": cid, "values": cand.values, "values_text": short_values(cand.values),
                        "state": entry.state, "chunks_done": entry.chunks_done,
                        "score": history[-1]["score"] if history else None, "reason": entry.reason,
                        "error": cand.error, "parent": run.info[cid].get("parent"),
                        "warm_from": run.info[cid].get("warm_from"), "history": history})
    records = [h for c in configs for h in c["history"]]
    busy = sum(h["train_s"] + h["eval_s"] + h["swap_in_s"] + h["swap_out_s"] for h in records)
    swap = sum(h["swap_in_s"] + h["swap_out_s"] for h in records)
    states: dict[str, int] = {}
    for c in configs:
        states[c["state"]] = states.get(c["state"], 0) + 1
    return {"name": run.exp.name, "status": status, "error": error, "metric": spec.metric, "mode": "min",
            "policy": spec.policy, "eta": spec.eta, "num_chunks": spec.num_chunks,
            "chunk_rows": [len(c) for c in run.data.chunks], "eval_rows": len(run.data.eval_rows),
            "search": OmegaConf.to_container(spec.search), "configs": configs, "best": best_of(configs), "cuts": run.sched.cuts,
            "ctl_log": run.ctl_log, "counts": ", ".join(f"{n} {s}" for s, n in sorted(states.items())),
            "swap": {"chunks": len(records), "swap_s": swap, "busy_s": busy,
                     "fraction": swap / busy if busy else 0.0,
                     "swap_in_s_mean": _mean([h["swap_in_s"] for h in records]),
                     "swap_out_s_mean": _mean([h["swap_out_s"] for h in records])},
            "config_chunks": len(records), "wall_s": wall_s}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def best_of(configs: list[dict]) -> dict | None:
    """The lowest score among the configs that trained the most chunks (scores after fewer chunks
    are not comparable with it)."""
    scored = [c for c in configs if c["score"] is not None and c["state"] != DELETED]
    if not scored:
        return None
    most = max(c["chunks_done"] for c in scored)
    best = min((c for c in scored if c["chunks_done"] == most), key=lambda c: c["score"])
    return {k: best[k] for k in ("id", "values", "values_text", "chunks_done", "score")}


def ranked(summary: dict) -> list[dict]:
    shown = [c for c in summary["configs"] if c["state"] != DELETED]
    inf = float("inf")
    return sorted(shown, key=lambda c: (-c["chunks_done"], inf if c["score"] is None else c["score"], c["id"]))


def render_leaderboard(summary: dict) -> str:
    """The leaderboard: rank, config, its values, chunks trained, the held-out metric, its state."""
    metric = summary["metric"]
    rows = [("#", "config", "values", "chunk", metric, "state")]
    for i, c in enumerate(ranked(summary), start=1):
        score = "-" if c["score"] is None else f"{c['score']:.4f}"
        note = c["state"] + (f" ({c['reason'] or c['error']})" if c["state"] in ("failed", "stopped") and
                             (c["reason"] or c["error"]) else "")
        rows.append((str(i), c["id"], c["values_text"], f"{c['chunks_done']}/{summary['num_chunks']}", score, note))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"experiment {summary['name']} ({summary['status']}, policy {summary['policy']}): "
             f"{summary['counts']}"]
    for r in rows:
        lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r[:5], widths)) + "  " + r[5])
    swap = summary.get("swap") or {}
    if swap.get("chunks"):
        lines.append(f"  {swap['chunks']} config-chunks; swap {swap['swap_s']:.2f}s of {swap['busy_s']:.1f}s in "
                     f"slots ({100 * swap['fraction']:.1f}%)")
    return "\n".join(lines)
