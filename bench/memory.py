"""Memory levels side by side in one run: saved-activation bytes, peak memory, step time, loss.

The same SFT job (model, data, fixed batch, steps, seed) through `rapidfire_ray.train` at
  - level0: nothing;
  - level1: selective checkpointing, with `memory_threshold` set so that the budget sits halfway
    between the batch's estimated peak with no block and with every block checkpointed (on this
    machine's free memory), so the plan has to choose: some blocks, not all;
  - level2: level1 + int8 saved activations (+ the allocator retry, which only acts on an OOM);
and, with 2 workers, level0 against level3 (DeepSpeed ZeRO-3): the parameter and optimizer-state
bytes each worker holds. Targets (issue 6): level2 saved-activation bytes <= 0.3x level0, step
time <= 1.25x, loss after the same steps within 1%; level3 per-worker parameter + optimizer
bytes <= 0.55x level0. On CPU "peak memory" is the process's peak resident set (allocator caches
and the Python heap included), so the saved-activation bytes counted by the hooks are the
precise measure. Writes bench/results/memory.json.

    python bench/memory.py [--model smollm2-135m] [--steps 8] [--batch 8] [--max-length 256] [--skip-zero]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "jobs", "data", "sft_sample.jsonl")


def run(args, name: str, out: str, workers: int = 1, **extra) -> dict:
    import rapidfire_ray

    overrides = {"run.name": name, "run.output_dir": out, "model.name": args.model, "data.path": DATA,
                 "data.max_length": args.max_length, "train.max_steps": args.steps, "train.lr_scheduler": "constant",
                 "train.per_device_batch_size": args.batch, "scaling.num_workers": workers,
                 "scaling.cpus_per_worker": args.threads if workers == 1 else 1, "checkpoint.every_steps": 0,
                 "train.precision": "fp32", **extra}
    t0 = time.time()
    s = rapidfire_ray.train(None, overrides=overrides)
    mem = s["memory"]
    return {"final_loss": s["final_loss"], "loss_history": [h["loss"] for h in s["loss_history"]],
            "step_time_s": round(s["train_time_s"] / max(1, s["steps"]), 4), "tokens_per_s": s["tokens_per_s"],
            "peak_memory_bytes": s["peak_memory_bytes"], "saved_activation_bytes": mem["saved_activation_bytes"],
            "saved_activation_raw_bytes": mem["saved_activation_raw_bytes"],
            "checkpointed_layers": mem["checkpointed_layers"], "checkpoint_plan": mem["checkpoint_plan"],
            "held_bytes_per_worker": mem["held_bytes_per_worker"][0], "wall_s": round(time.time() - t0, 1)}


def halfway_threshold(args) -> tuple[float, dict]:
    """memory_threshold whose budget lies halfway between the fixed batch's estimated peak with no
    checkpointed block and with all of them."""
    from dataclasses import replace

    import torch

    from rapidfire_ray.memory import MemoryModel, free_memory_bytes
    from rapidfire_ray.models import load_model

    model = MemoryModel.for_model(load_model(args.model, dtype=torch.float32))
    none = model.peak_bytes(args.batch, args.max_length)
    every = replace(model, checkpointed_layers=model.num_layers).peak_bytes(args.batch, args.max_length)
    free = free_memory_bytes(torch.device("cpu"))
    return round((none + every) / 2 / free, 6), {"peak_no_checkpointing": none, "peak_all_checkpointed": every,
                                                  "free_bytes": free}


def ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-zero", action="store_true", help="leave out the 2-worker level0/level3 pair")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "memory.json"))
    args = p.parse_args()

    threshold, plan = halfway_threshold(args)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="rapidfire-bench-memory-") as out:
        for level in ("level0", "level1", "level2"):
            print(f"== {level}", flush=True)
            runs[level] = run(args, level, out, **{"memory.optim_level": level,
                                                   "data.dynamic_batch.memory_threshold": threshold})
        if not args.skip_zero:
            for level in ("level0", "level3"):
                print(f"== {level}, 2 workers", flush=True)
                runs[f"{level}-2w"] = run(args, f"{level}-2w", out, workers=2, **{"memory.optim_level": level})

    base = runs["level0"]
    ratios = {level: {"saved_activation_bytes": ratio(r["saved_activation_bytes"], base["saved_activation_bytes"]),
                      "step_time": ratio(r["step_time_s"], base["step_time_s"]),
                      "peak_memory": ratio(r["peak_memory_bytes"], base["peak_memory_bytes"]),
                      "final_loss_rel_diff": round(abs(r["final_loss"] - base["final_loss"]) / base["final_loss"], 4)}
              for level, r in runs.items() if level in ("level1", "level2")}
    if "level3-2w" in runs and runs["level3-2w"]["held_bytes_per_worker"] and runs["level0-2w"]["held_bytes_per_worker"]:
        held = {k: runs[k]["held_bytes_per_worker"] for k in ("level0-2w", "level3-2w")}
        both = {k: v["parameters"] + v["optimizer_state"] for k, v in held.items()}
        ratios["level3-2w"] = {"param_plus_optimizer_bytes_per_worker": ratio(both["level3-2w"], both["level0-2w"]),
                               "step_time": ratio(runs["level3-2w"]["step_time_s"], runs["level0-2w"]["step_time_s"])}
    targets = {
        "level2_saved_activation_bytes_le_0.3x": (ratios["level2"]["saved_activation_bytes"] or 9) <= 0.3,
        "level2_step_time_le_1.25x": (ratios["level2"]["step_time"] or 9) <= 1.25,
        "level2_loss_within_1pct": ratios["level2"]["final_loss_rel_diff"] <= 0.01,
    }
    if "level3-2w" in ratios:
        targets["level3_param_optimizer_bytes_le_0.55x"] = \
            (ratios["level3-2w"]["param_plus_optimizer_bytes_per_worker"] or 9) <= 0.55
    result = {"bench": "memory", "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
              "cpus": os.cpu_count(), "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
              "settings": vars(args) | {"memory_threshold": threshold, **plan}, "runs": runs, "ratios": ratios,
              "targets_met": targets}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({"ratios": ratios, "targets_met": targets}, indent=2))


if __name__ == "__main__":
    main()
