"""Data layer: padding, throughput and data wait, side by side in one run.

Four runs of the same SFT job (model, data, steps, memory ceiling) through `rapidfire_ray.train`:
  - fixed:        per_device_batch_size rows, padded to the longest (today's HF behaviour);
  - token_budget: length-sorted batches under the same padded-token ceiling (batch x max_length);
  - memory_aware: batch sizes from the memory model, with the threshold set so that its budget is
    the fixed run's estimated peak (the same memory ceiling);
  - fixed, prefetch_depth 0: the data-wait baseline for prefetch_depth 3.
The sample data is long-tailed (46 to 527 characters), like chat data. Prints the ratios and
writes bench/results/data_pipeline.json.

    python bench/data_pipeline.py [--model smollm2-135m] [--steps 12] [--batch 8] [--max-length 256]
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


def run(args, name: str, out: str, **extra) -> dict:
    import rapidfire_ray

    overrides = {"run.name": name, "run.output_dir": out, "model.name": args.model, "data.path": DATA,
                 "data.max_length": args.max_length, "train.max_steps": args.steps,
                 "train.per_device_batch_size": args.batch, "scaling.num_workers": 1,
                 "scaling.cpus_per_worker": args.threads, "checkpoint.every_steps": 0, **extra}
    s = rapidfire_ray.train(None, overrides=overrides)
    keep = ("tokens", "samples", "tokens_per_s", "padding_fraction", "train_time_s", "peak_memory_bytes")
    return {k: s[k] for k in keep} | {"data_wait_fraction": s["time_breakdown"]["data_wait"],
                                       "memory_model": s.get("memory_model")}


def same_memory_threshold(args) -> tuple[float, int]:
    """The memory_threshold at which memory_aware's budget equals the fixed run's estimated peak
    (fixed state + a full batch of max_length rows), given this machine's free memory."""
    import torch

    from rapidfire_ray.memory import MemoryModel, free_memory_bytes
    from rapidfire_ray.models import load_model

    model = MemoryModel.for_model(load_model(args.model, dtype=torch.float32))
    ceiling = model.peak_bytes(args.batch, args.max_length)
    return round(ceiling / free_memory_bytes(torch.device("cpu")), 4), ceiling


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "data_pipeline.json"))
    args = p.parse_args()
    ceiling = args.batch * args.max_length
    threshold, memory_ceiling = same_memory_threshold(args)
    with tempfile.TemporaryDirectory() as out:
        fixed = run(args, "fixed", out)
        budget = run(args, "token-budget", out, **{"data.dynamic_batch.strategy": "token_budget",
                                                   "data.dynamic_batch.max_tokens": ceiling})
        memory = run(args, "memory-aware", out, **{"data.dynamic_batch.strategy": "memory_aware",
                                                   "data.dynamic_batch.memory_threshold": threshold})
        no_prefetch = run(args, "fixed-no-prefetch", out, **{"data.prefetch_depth": 0})
    result = {
        "benchmark": "data_pipeline", "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "settings": vars(args) | {"padded_token_ceiling": ceiling, "memory_threshold": threshold,
                                  "memory_ceiling_bytes": memory_ceiling},
        "fixed": fixed, "token_budget": budget, "memory_aware": memory, "fixed_prefetch_0": no_prefetch,
        "tokens_per_s_ratio_token_budget_over_fixed": round(budget["tokens_per_s"] / fixed["tokens_per_s"], 3),
        "tokens_per_s_ratio_memory_aware_over_fixed": round(memory["tokens_per_s"] / fixed["tokens_per_s"], 3),
    }
    print(f"[bench] padding: fixed {fixed['padding_fraction']:.1%}, token_budget {budget['padding_fraction']:.1%}, "
          f"memory_aware {memory['padding_fraction']:.1%}")
    print(f"[bench] tokens/s: fixed {fixed['tokens_per_s']:.1f}, token_budget {budget['tokens_per_s']:.1f} "
          f"(ratio {result['tokens_per_s_ratio_token_budget_over_fixed']}), memory_aware "
          f"{memory['tokens_per_s']:.1f} (ratio {result['tokens_per_s_ratio_memory_aware_over_fixed']})")
    print(f"[bench] data wait share: prefetch 3 {fixed['data_wait_fraction']:.2%}, "
          f"prefetch 0 {no_prefetch['data_wait_fraction']:.2%}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
