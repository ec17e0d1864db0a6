"""The whole pipeline on the sample task, and the reward pool's batching (issue 7's evidence).

1. `jobs/configs/pipeline.yaml` as it is (SmolLM2-135M-Instruct, 2 Ray Train workers): SFT, then
   the reward model from the SFT model, then GRPO of the SFT model against the reward model plus
   the answer checker. Reported: the reward model's held-out pairwise accuracy (target >= 0.8) and
   margin; task score (answer_match) and mean reward of the SFT model and of the RL model on the
   held-out prompts (greedy decoding; the RL model must be measurably better).
2. The RL stage again from the same SFT and reward models for --batch-steps steps, twice, side by
   side: the reward actor scoring completions in batches (rl.reward.batch_size 16) and one
   completion per call (1). Reported: rollout tokens/s = generated tokens / (generation + reward
   scoring seconds), summed over workers, and reward seconds per step.

Writes bench/results/pipeline.json.

    python bench/pipeline.py [--rl-steps 20] [--batch-steps 3] [--model smollm2-135m]
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
PIPELINE = os.path.join(REPO, "jobs", "configs", "pipeline.yaml")


def say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def rollout_rate(steps_path: str) -> dict:
    """Generated tokens per second of generation + reward scoring, per rank then summed."""
    with open(steps_path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    rate, reward_s, steps = 0.0, [], 0
    for rank in sorted({r["rank"] for r in records}):
        mine = [r for r in records if r["rank"] == rank]
        seconds = sum(r["phases"].get("rollout", 0.0) + r["phases"].get("reward", 0.0) for r in mine)
        rate += sum(r["tokens"] for r in mine) / seconds if seconds else 0.0
        reward_s += [r["phases"].get("reward", 0.0) for r in mine]
        steps = max(steps, len(mine))
    return {"rollout_tokens_per_s": round(rate, 3),
            "reward_s_per_step": round(sum(reward_s) / len(reward_s), 4) if reward_s else None, "steps": steps}


def main() -> None:
    import rapidfire_ray
    from rapidfire_ray.config import load_config
    from rapidfire_ray.driver.pipeline import stage_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rl-steps", type=int, default=None, help="RL steps of the pipeline (default: the profile's)")
    p.add_argument("--batch-steps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "pipeline.json"))
    p.add_argument("--work-dir", default=None,
                   help="where the runs go (default: a temporary folder, removed at the end); with a folder kept "
                        "from an interrupted run the pipeline resumes at the stage where it stopped")
    args = p.parse_args()
    result = {"benchmark": "pipeline", "date": time.strftime("%Y-%m-%d"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
              "settings": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        out = args.work_dir or tmp
        overrides = {"run.output_dir": out, "run.name": "pipeline", "model.name": args.model}
        if args.rl_steps:
            overrides["pipeline.rl.train.max_steps"] = args.rl_steps
        t0 = time.perf_counter()
        resume = bool(args.work_dir) and os.path.isdir(os.path.join(out, "pipeline"))
        s = rapidfire_ray.train(PIPELINE, overrides=overrides, resume=resume)
        result["pipeline"] = s
        result["pipeline_wall_s"] = round(time.perf_counter() - t0, 1)
        ev = s["results"]["reward"].get("reward_eval") or {}
        cmp = s.get("comparison") or {}
        say(f"reward model: held-out accuracy {ev.get('accuracy')} (target >= 0.8), margin {ev.get('margin_mean')}, "
            f"{ev.get('pairs')} pairs")
        if cmp:
            say(f"held-out prompts ({cmp['prompts']}): task score SFT {cmp['sft_model']['task_score']} -> RL "
                f"{cmp['rl_model']['task_score']}; mean reward {cmp['sft_model']['mean_reward']} -> "
                f"{cmp['rl_model']['mean_reward']}")

        write(result, args.out)  # the pipeline's part, in case the batching comparison is interrupted
        cfg = load_config(PIPELINE, overrides)
        models = {"sft": s["results"]["sft"]["model_dir"], "reward": s["results"]["reward"]["model_dir"]}
        rl_cfg = stage_config(cfg, "rl", models)
        batching = {}
        for bs in (16, 1):
            name = f"rl-batch{bs}"
            say(f"{name}: {args.batch_steps} RL steps, reward actor scoring {bs} completion(s) per call")
            rapidfire_ray.train(rl_cfg, overrides={"run.name": name, "train.max_steps": args.batch_steps,
                                                   "rl.eval_path": None, "rl.reward.batch_size": bs})
            batching[bs] = rollout_rate(os.path.join(rl_cfg.run.output_dir, name, "steps.jsonl"))
            say(f"  rollout {batching[bs]['rollout_tokens_per_s']} tokens/s, reward "
                f"{batching[bs]['reward_s_per_step']} s/step")
        ratio = batching[16]["rollout_tokens_per_s"] / batching[1]["rollout_tokens_per_s"]
        result["batching"] = {"batch_16": batching[16], "batch_1": batching[1], "ratio": round(ratio, 3)}
        say(f"rollout tokens/s, batched vs one at a time: {ratio:.2f}x")
    write(result, args.out)


def write(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(path + ".tmp", path)
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
