"""Control ops applied by the experiment's loop: stop, resume, delete, clone (cold or warm), and
pbt's clones (`exploit`: a warm clone with perturbed values, logged like a ctl clone).

An op waits while its config is in flight and is applied at that config's next chunk boundary;
each one is logged with who asked, when, what, when it was applied and after which chunk
(`ctl_log.jsonl` in the experiment folder, and the summary's `ctl_log`).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time

import ray
from omegaconf import OmegaConf

from ..log import say
from .scheduler import DELETED, DONE, RUNNING, STOPPED
from .spec import FIXED_PREFIXES, perturb, short_values, validate_candidate


def apply_pending(run) -> None:
    if run.controller is not None:
        run.pending_ops += ray.get(run.controller.take.remote(), timeout=60)
    waiting = []
    for op in run.pending_ops:
        entry = run.sched.configs.get(op["run"])
        if entry is not None and entry.in_flight:
            waiting.append(op)  # mid-chunk: at its next boundary
            continue
        if entry is None:
            result = f"refused: no config '{op['run']}'"
        else:
            result = APPLY[op["op"]](run, op, entry)
        _record(run, op, result, None if entry is None else entry.chunks_done)
    run.pending_ops = waiting


def _stop(run, op, entry) -> str:
    if entry.state != RUNNING:
        return f"nothing to do: it is {entry.state}"
    entry.state, entry.reason = STOPPED, f"stopped by ctl ({op['who']})"
    return f"stopped after chunk {entry.chunks_done}"


def _resume(run, op, entry) -> str:
    if entry.state != STOPPED:
        return f"nothing to do: it is {entry.state}"
    entry.state = DONE if entry.chunks_done >= run.sched.num_chunks else RUNNING
    entry.reason = None
    return f"resumed at chunk {entry.chunks_done + 1}" if entry.state == RUNNING else "resumed: it has every chunk"


def _delete(run, op, entry) -> str:
    if entry.state == DELETED:
        return "nothing to do: it is deleted"
    entry.state, entry.reason = DELETED, f"deleted by ctl ({op['who']})"
    return "deleted (off the leaderboard; its state stays on storage)"


def _clone(run, op, entry) -> str:
    parent = run.cands[op["run"]]
    overrides = op.get("overrides") or {}
    bad = [k for k in overrides if any(k == p.rstrip(".") or k.startswith(p) for p in FIXED_PREFIXES)]
    cid = f"c{len(run.sched.configs)}"
    cand = validate_candidate(run.exp.base, {**parent.values, **overrides}, cid, parent=parent.id)
    if bad:
        cand.cfg, cand.error = None, f"{bad[0]}: cannot be changed in a clone (every config trains the same data)"
    warm = op.get("warm")
    if warm and cand.error is None:
        if entry.chunks_done == 0 or run.states.get(parent.id) is None:
            cand.cfg, cand.error = None, "--warm: the parent has finished no chunk yet, there is no state to start from"
        elif _shape(cand.cfg) != _shape(parent.cfg):
            cand.cfg, cand.error = None, ("--warm: model.lora.r and target_modules must stay the parent's (its "
                                          "adapter's shape)")
    run.add(cand, chunks_done=entry.chunks_done if warm and cand.error is None else 0,
            state=run.states.get(parent.id) if warm and cand.error is None else None,
            warm_from=parent.id if warm else None)
    if cand.error is not None:
        return f"clone {cid} failed: {cand.error}"
    if warm:  # its own copy of the parent's boundary state, for --resume before its first chunk
        if parent.id in run.state_nodes:
            run.state_nodes[cid] = run.state_nodes[parent.id]  # the same object
        src, dst = run.state_path(parent.id, entry.chunks_done), run.state_path(cid, entry.chunks_done)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)
    start = entry.chunks_done + 1 if warm else 1
    return f"cloned as {cid} ({short_values(cand.values)}), {'warm' if warm else 'cold'}, from chunk {start}"


def exploit(run, ask: dict) -> None:
    """pbt (scheduler.take_exploits): a warm clone of `ask['parent']` with its searched values
    perturbed (seeded by the experiment's seed, the boundary and the config it replaces)."""
    spec = run.exp.spec
    parent = run.cands[ask["parent"]]
    seed = run.seed if spec.seed is None else spec.seed  # run.seed: the base config's
    rng = random.Random(f"{seed}-pbt-{ask['after_chunk']}-{ask['replaces']}")
    values = perturb(parent.values, OmegaConf.to_container(spec.search), rng, tuple(spec.perturb_factors))
    op = {"op": "clone", "run": parent.id, "overrides": {k: v for k, v in values.items() if v != parent.values.get(k)},
          "warm": True, "who": f"policy pbt (replaces {ask['replaces']})",
          "asked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    entry = run.sched.configs[parent.id]
    _record(run, op, _clone(run, op, entry), entry.chunks_done)


def _shape(cfg) -> tuple:
    lora = cfg.model.lora
    targets = lora.target_modules
    return lora.r, targets if isinstance(targets, str) else tuple(targets)


APPLY = {"stop": _stop, "resume": _resume, "delete": _delete, "clone": _clone}


def _record(run, op: dict, result: str, after_chunk: int | None) -> None:
    entry = {**op, "applied_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "after_chunk": after_chunk,
             "result": result}
    run.ctl_log.append(entry)
    os.makedirs(run.folder, exist_ok=True)
    with open(os.path.join(run.folder, "ctl_log.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
    extra = " " + " ".join(f"{k}={v}" for k, v in op.get("overrides", {}).items()) if op.get("overrides") else ""
    say(f"ctl {op['op']} {op['run']}{extra}{' --warm' if op.get('warm') else ''} (asked by {op['who']} at "
        f"{op['asked_at']}): {result}")
