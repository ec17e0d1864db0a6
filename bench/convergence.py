"""Convergence parity: SFT of smollm2-135m on the sample data, same samples, seed and schedule,
with AdamW over a plain fp32 allreduce and with `rapidfire_adamw` (1-bit momentum after a
20% warm-up), 2 workers, side by side in one run. Target: final loss of rapidfire_adamw within
2% of AdamW's. Also reports the loss gap along the run, the bytes each worker sent per step,
and step times. Writes bench/results/convergence.json.

    python bench/convergence.py [--steps 40] [--model smollm2-135m] [--lr 5e-5] [--freeze-step N]
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
QUICKSTART = os.path.join(REPO, "jobs", "configs", "quickstart.yaml")


def run(args, name: str, out: str, **extra) -> dict:
    import rapidfire_ray

    overrides = {"run.name": name, "run.output_dir": out, "model.name": args.model,
                 "data.path": os.path.join(REPO, "jobs", "data", "sft_sample.jsonl"), "train.max_steps": args.steps,
                 "optimizer.params.lr": args.lr, "checkpoint.every_steps": 0, "scaling.num_workers": 2, **extra}
    s = rapidfire_ray.train(QUICKSTART, overrides=overrides)
    return {"final_loss": s["final_loss"], "first_loss": s["first_loss"], "loss_history": s["loss_history"],
            "train_time_s": s["train_time_s"], "steps": s["steps"], "communication": s["communication"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--freeze-step", type=int, default=None,
                   help="rapidfire_adamw warm-up steps (default: 20%% of --steps, the optimizer's own default)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "convergence.json"))
    args = p.parse_args()
    freeze = args.freeze_step or max(1, args.steps // 5)
    with tempfile.TemporaryDirectory() as out:
        adamw = run(args, "adamw", out)
        onebit = run(args, "rapidfire-adamw", out, **{"optimizer.type": "rapidfire_adamw",
                                                        "optimizer.params.compression.grad": "1bit",
                                                        "optimizer.params.freeze_step": freeze})
    gap = onebit["final_loss"] / adamw["final_loss"] - 1
    along = [{"step": a["step"], "adamw": a["loss"], "rapidfire_adamw": b["loss"],
              "gap": round(b["loss"] / a["loss"] - 1, 4)}
             for a, b in zip(adamw["loss_history"], onebit["loss_history"])]
    result = {"benchmark": "convergence", "date": time.strftime("%Y-%m-%d"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
              "settings": vars(args) | {"freeze_step": freeze, "workers": 2},
              "adamw": adamw, "rapidfire_adamw": onebit, "final_loss_gap": round(gap, 4), "along": along}
    print(f"[bench] final loss: adamw {adamw['final_loss']:.4f}, rapidfire_adamw {onebit['final_loss']:.4f} "
          f"(gap {gap:+.2%}; target within 2%)")
    print(f"[bench] bytes per step per worker: adamw {adamw['communication']['bytes_sent_per_step']:,}, "
          f"rapidfire_adamw {onebit['communication']['bytes_sent_per_step']:,} (mean over the run, warm-up included)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
