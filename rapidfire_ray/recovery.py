"""What a run's failures cost, from the step records every rank pushed (`steps.jsonl`).

After a worker dies, Ray Train restarts the worker group (scaling.max_failures), which resumes
from the latest checkpoint: the steps after that checkpoint run again. A rank's records then go
back in step number, and they come from a new worker process (`pid`; a restart that resumes from
a checkpoint at its last step repeats no step). From them: the restarts, the step each resumed
from, the steps and samples trained twice (the last record of a (rank, step) counts, the earlier
ones were redone), steps skipped (none expected), and the time between the last step before a
failure and the first after.

Records stamped with their worker group (`attempt`, every run with a process group) are counted
by worker group instead, which also holds when the worker count changes between groups (elastic
runs): a step's records from its last worker group count, those of earlier groups were redone.
"""
from __future__ import annotations


def recovery_summary(steps: list[dict], checkpoint_fallback: str | None = None, *,
                     damaged: list[dict] | None = None) -> dict:
    """`checkpoint_fallback`: the line said when a damaged checkpoint was skipped; `damaged`: the
    checkpoints set aside at the start of a resumed run ({checkpoint, reason, kept_as})."""
    out = _by_attempt(steps, checkpoint_fallback) if steps and all(r.get("attempt") is not None for r in steps) \
        else _by_rank(steps, checkpoint_fallback)
    if damaged:
        out["damaged_checkpoints"] = list(damaged)
    return out


def _by_rank(steps: list[dict], checkpoint_fallback: str | None) -> dict:
    by_rank: dict[int, list[dict]] = {}
    for record in steps:  # the board keeps each rank's records in the order it pushed them
        by_rank.setdefault(record["rank"], []).append(record)
    restarts: list[dict] = []
    retrained_steps: set[int] = set()
    retrained_samples = 0
    skipped: set[int] = set()
    unique_samples = 0
    for rank, records in sorted(by_rank.items()):
        last_of = {}
        for i, r in enumerate(records):
            if i and (r["step"] <= records[i - 1]["step"] or r.get("pid") != records[i - 1].get("pid")):
                if rank == min(by_rank):
                    restarts.append({"resumed_from_step": r["step"] - 1, "failed_after_step": records[i - 1]["step"],
                                     "lost_s": round(r["time"] - records[i - 1]["time"], 3)})
            last_of[r["step"]] = i
        for i, r in enumerate(records):
            if last_of[r["step"]] != i:
                retrained_steps.add(r["step"])
                retrained_samples += r["samples"]
            else:
                unique_samples += r["samples"]
        seen = set(last_of)
        skipped |= set(range(min(seen), max(seen) + 1)) - seen
    out = {
        "restarts": len(restarts),
        "resumes": restarts,
        "steps_trained_twice": len(retrained_steps),
        "samples_trained_twice": retrained_samples,
        "steps_skipped": sorted(skipped),
        "unique_samples": unique_samples,
    }
    if checkpoint_fallback:
        out["checkpoint_fallback"] = checkpoint_fallback
    return out


def _by_attempt(steps: list[dict], checkpoint_fallback: str | None) -> dict:
    groups: dict[int, list[dict]] = {}
    for r in steps:
        groups.setdefault(r["attempt"], []).append(r)
    order = sorted(groups)
    resumes = []
    for before, after in zip(order, order[1:]):
        first = min(groups[after], key=lambda r: (r["step"], r["rank"]))
        last = max(groups[before], key=lambda r: (r["step"], -r["rank"]))
        resumes.append({"resumed_from_step": first["step"] - 1, "failed_after_step": last["step"],
                        "lost_s": round(first["time"] - last["time"], 3)})
    final = {}
    for r in steps:
        final[r["step"]] = max(final.get(r["step"], -1), r["attempt"])
    retrained_steps = {r["step"] for r in steps if r["attempt"] != final[r["step"]]}
    out = {
        "restarts": len(order) - 1,
        "resumes": resumes,
        "steps_trained_twice": len(retrained_steps),
        "samples_trained_twice": sum(r["samples"] for r in steps if r["attempt"] != final[r["step"]]),
        "steps_skipped": sorted(set(range(min(final), max(final) + 1)) - set(final)),
        "unique_samples": sum(r["samples"] for r in steps if r["attempt"] == final[r["step"]]),
    }
    if checkpoint_fallback:
        out["checkpoint_fallback"] = checkpoint_fallback
    return out


def final_world_size(steps: list[dict], cfg) -> int:
    """The worker count that trained the run's last step (the configured one without records)."""
    from .config import worker_range

    if not steps:
        return worker_range(cfg)[1]
    last = max((r.get("attempt") or 0, r["step"]) for r in steps)
    return len({r["rank"] for r in steps if ((r.get("attempt") or 0), r["step"]) == last})


def elastic_summary(cfg, steps: list[dict], starts: list[dict | None], rows: int) -> dict:
    """An elastic run's worker groups (count, steps, batch, where each resumed in the data) and
    the sample accounting: rows trained once, rows trained twice (steps after a checkpoint
    redone), rows that could not be trained (fewer left in an epoch than workers)."""
    from .config import worker_range

    lo, hi = worker_range(cfg)
    groups = []
    for attempt, start in enumerate(starts):
        mine = [r for r in steps if r.get("attempt") == attempt]
        groups.append({"attempt": attempt, **(start or {}),
                       "steps": [min(r["step"] for r in mine), max(r["step"] for r in mine)] if mine else None})
    rec = recovery_summary(steps)
    out = {"min_workers": lo, "max_workers": hi, "batch": cfg.scaling.elastic.batch, "worker_groups": groups,
           "resizes": sum(1 for a, b in zip(groups, groups[1:]) if a.get("world_size") != b.get("world_size")),
           "samples_trained_once": rec["unique_samples"], "samples_trained_twice": rec["samples_trained_twice"],
           "untrainable_rows": sum(g.get("untrainable_rows") or 0 for g in groups)}
    if cfg.train.max_steps == -1:
        out["expected_samples"] = int(cfg.train.epochs) * rows
    return out


def elastic_line(el: dict) -> str:
    counts = " -> ".join(f"{g.get('world_size', '?')}" + (f" (steps {g['steps'][0]}-{g['steps'][1]})" if g["steps"]
                                                         else " (no step)") for g in el["worker_groups"])
    expected = f" of {el['expected_samples']} expected" if "expected_samples" in el else ""
    return (f"elastic: workers {counts}; {el['resizes']} resize(s); {el['samples_trained_once']} samples trained "
            f"once{expected}, {el['samples_trained_twice']} twice, {el['untrainable_rows']} left untrained")


def recovery_line(rec: dict) -> str | None:
    """The summary's recovery line: the worker-group restarts and what they cost, and a damaged
    checkpoint skipped at resume (what was resumed from instead); None if neither happened."""
    fallback = rec.get("checkpoint_fallback")
    if not rec["restarts"]:
        return f"resumed past a damaged checkpoint: {fallback}" if fallback else None
    resumed = ", ".join(f"step {r['resumed_from_step']} ({r['lost_s']:.1f} s between steps)" for r in rec["resumes"])
    return (f"recovered from {rec['restarts']} worker-group restart(s), resumed at {resumed}: "
            f"{rec['steps_trained_twice']} step(s) / {rec['samples_trained_twice']} samples trained twice (those "
            f"after the last checkpoint), {len(rec['steps_skipped'])} skipped"
            + (f"; damaged checkpoint: {fallback}" if fallback else ""))
