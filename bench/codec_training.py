"""The native 1-bit CPU kernels in training: the same `rapidfire_adamw` run (1-bit compressed
momentum after its warm-up, 2 workers, SmolLM2-135M, the quickstart's data, 16 steps) with
RAPIDFIRE_CODEC_NATIVE=off (the compiled kernels) and =always (the native ones, built first),
one after the other in one invocation. Both paths compute the same bits, so the losses must be
equal; what differs is tokens/s and the exchange's time. Each run is its own process (the
variable reaches the Ray workers through the environment they inherit). Writes
bench/results/codec_training.json. A benchmark, not a test.

    python bench/codec_training.py [--steps 16] [--out bench/results/codec_training.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = r'''
import json, sys, rapidfire_ray
out, steps = sys.argv[1], int(sys.argv[2])
s = rapidfire_ray.train("jobs/configs/quickstart.yaml", overrides={
    "run.name": "codec-training", "run.output_dir": out, "train.max_steps": steps, "checkpoint.every_steps": 0,
    "scaling.num_workers": 2, "optimizer.type": "rapidfire_adamw", "optimizer.params.compression.grad": "1bit"})
keep = {k: s.get(k) for k in ("steps", "final_loss", "tokens_per_s", "communication")}
keep["losses"] = [h["loss"] for h in s["loss_history"]]
print("RESULT " + json.dumps(keep))
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "codec_training.json"))
    args = p.parse_args()
    if subprocess.run([sys.executable, "-c", "from rapidfire_ray.compression import native; "
                       "import os; os.environ['RAPIDFIRE_CODEC_NATIVE'] = 'always'; native.module()"],
                      cwd=REPO).returncode:
        sys.exit("bench: the native kernels did not build (see the error above)")
    runs = {}
    for mode in ("off", "always"):
        print(f"[bench] rapidfire_adamw, 2 workers, {args.steps} steps, RAPIDFIRE_CODEC_NATIVE={mode}", flush=True)
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", RUN, out, str(args.steps)], cwd=REPO, capture_output=True,
                                  text=True, env=dict(os.environ, RAPIDFIRE_CODEC_NATIVE=mode))
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                sys.exit(f"bench: the {mode} run failed:\n{done.stderr[-3000:]}")
            runs[mode] = {"wall_s": round(time.perf_counter() - start, 1), **json.loads(lines[-1][len("RESULT "):])}
        c = runs[mode]["communication"]
        print(f"[bench]   {runs[mode]['tokens_per_s']:.1f} tokens/s, exchange p50 {c['comm_latency_p50_s']:.2f} s, "
              f"in flight {c['in_flight_s_per_step']:.2f} s per step, final loss {runs[mode]['final_loss']}", flush=True)
    off, native = runs["off"], runs["always"]
    result = {
        "benchmark": "codec_training", "date": time.strftime("%Y-%m-%d"), "commit": _commit(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "settings": vars(args), "runs": runs,
        "tokens_per_s_ratio": round(native["tokens_per_s"] / off["tokens_per_s"], 3),
        "same_losses": off["losses"] == native["losses"],
    }
    print(f"[bench] native / compiled: {result['tokens_per_s_ratio']:.2f}x tokens/s; "
          f"losses {'identical' if result['same_losses'] else 'DIFFER'}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"[bench] wrote {args.out}")


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()
