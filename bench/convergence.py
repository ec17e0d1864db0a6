"""Convergence parity: SFT of smollm2-135m on the sample data, same samples, seed and schedule,
with AdamW over a plain fp32 allreduce and with `rapidfire_adamw` (1-bit momentum after a
20% warm-up), 2 workers, side by side in one run. Target: final loss of rapidfire_adamw within
2% of AdamW's. The last --heldout rows of the sample data are kept out of training and each
run's final model is scored on them (bench/heldout.py): the held-out loss of the final model,
next to the last step's training loss (one batch) and the mean of the last 10 steps. Also
reports the loss gap along the run, the bytes each worker sent per step, and step times.
Writes bench/results/convergence.json.

    python bench/convergence.py [--steps 40] [--model smollm2-135m] [--lr 5e-5] [--freeze-step N]
        [--heldout 120] [--chunk-size N] [--seed 42]
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

from heldout import heldout_loss, split_data  # noqa: E402  (bench/heldout.py, beside this script)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "jobs", "configs", "quickstart.yaml")


def run(args, name: str, out: str, **extra) -> dict:
    import rapidfire_ray

    overrides = {"run.name": name, "run.output_dir": out, "model.name": args.model, "data.path": args.train_data,
                 "data.max_length": args.max_length, "train.max_steps": args.steps,
                 "optimizer.params.lr": args.lr, "run.seed": args.seed, "checkpoint.every_steps": 0, "scaling.num_workers": 2, **extra}
    s = rapidfire_ray.train(QUICKSTART, overrides=overrides)
    losses = [h["loss"] for h in s["loss_history"]]
    result = {"final_loss": s["final_loss"], "first_loss": s["first_loss"],
              "last10_mean_loss": round(sum(losses[-10:]) / len(losses[-10:]), 6), "loss_history": s["loss_history"],
              "train_time_s": s["train_time_s"], "steps": s["steps"], "communication": s["communication"]}
    if args.heldout_rows:
        result["heldout_loss"] = round(heldout_loss(os.path.join(out, name, "model"), args.heldout_rows,
                                                    args.max_length), 6)
    print(f"[bench] {name}: final loss {result['final_loss']:.4f}, last-10 mean {result['last10_mean_loss']:.4f}"
          + (f", held-out {result['heldout_loss']:.4f}" if "heldout_loss" in result else ""), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--freeze-step", type=int, default=None,
                   help="rapidfire_adamw warm-up steps (default: 20%% of --steps, the optimizer's own default)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="optimizer.params.compression.chunk_size of the 1-bit codec (default: the config's)")
    p.add_argument("--seed", type=int, default=42,
                   help="run.seed of both runs (the quickstart's 42): data order, initialisation of new heads")
    p.add_argument("--max-length", type=int, default=256, help="data.max_length (the quickstart's)")
    p.add_argument("--heldout", type=int, default=120,
                   help="last rows of the sample data kept out of training and scored at the end (0: none)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "convergence.json"))
    args = p.parse_args()
    freeze = args.freeze_step or max(1, args.steps // 5)
    onebit_overrides = {"optimizer.type": "rapidfire_adamw", "optimizer.params.compression.grad": "1bit",
                        "optimizer.params.freeze_step": freeze}
    if args.chunk_size:
        onebit_overrides["optimizer.params.compression.chunk_size"] = args.chunk_size
    with tempfile.TemporaryDirectory() as out:
        args.train_data, args.heldout_rows = split_data(out, args.heldout)
        adamw = run(args, "adamw", out)
        onebit = run(args, "rapidfire-adamw", out, **onebit_overrides)
    del args.heldout_rows, args.train_data  # rows and a temporary path, not settings
    gap = onebit["final_loss"] / adamw["final_loss"] - 1
    gaps = {"final_step": round(gap, 4),
            "last10_mean": round(onebit["last10_mean_loss"] / adamw["last10_mean_loss"] - 1, 4)}
    if "heldout_loss" in adamw:
        gaps["heldout"] = round(onebit["heldout_loss"] / adamw["heldout_loss"] - 1, 4)
    along = [{"step": a["step"], "adamw": a["loss"], "rapidfire_adamw": b["loss"],
              "gap": round(b["loss"] / a["loss"] - 1, 4)}
             for a, b in zip(adamw["loss_history"], onebit["loss_history"])]
    result = {"benchmark": "convergence", "date": time.strftime("%Y-%m-%d"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
              "settings": vars(args) | {"freeze_step": freeze, "workers": 2},
              "adamw": adamw, "rapidfire_adamw": onebit, "final_loss_gap": round(gap, 4), "gaps": gaps,
              "along": along}
    print(f"[bench] final loss: adamw {adamw['final_loss']:.4f}, rapidfire_adamw {onebit['final_loss']:.4f} "
          f"(gap {gap:+.2%}; target within 2%); last-10 mean {gaps['last10_mean']:+.2%}"
          + (f"; held-out {adamw['heldout_loss']:.4f} vs {onebit['heldout_loss']:.4f} ({gaps['heldout']:+.2%})"
             if "heldout" in gaps else ""))
    print(f"[bench] bytes per step per worker: adamw {adamw['communication']['bytes_sent_per_step']:,}, "
          f"rapidfire_adamw {onebit['communication']['bytes_sent_per_step']:,} (mean over the run, warm-up included)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
