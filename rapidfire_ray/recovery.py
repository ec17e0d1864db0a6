"""What a run's failures cost, from the step records every rank pushed (`steps.jsonl`).

After a worker dies, Ray Train restarts the worker group (scaling.max_failures), which resumes
from the latest checkpoint: the steps after that checkpoint run again. A rank's records then go
back in step number, and they come from a new worker process (`pid`; a restart that resumes from
a checkpoint at its last step repeats no step). From them: the restarts, the step each resumed
from, the steps and samples trained twice (the last record of a (rank, step) counts, the earlier
ones were redone), steps skipped (none expected), and the time between the last step before a
failure and the first after.
"""
from __future__ import annotations


def recovery_summary(steps: list[dict], checkpoint_fallback: str | None = None) -> dict:
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


def recovery_line(rec: dict) -> str | None:
    if not rec["restarts"] and "checkpoint_fallback" not in rec:
        return None
    resumed = ", ".join(f"step {r['resumed_from_step']} ({r['lost_s']:.1f} s between steps)" for r in rec["resumes"])
    return (f"recovered from {rec['restarts']} worker-group restart(s), resumed at {resumed or '-'}: "
            f"{rec['steps_trained_twice']} step(s) / {rec['samples_trained_twice']} samples trained twice (those "
            f"after the last checkpoint), {len(rec['steps_skipped'])} skipped")
