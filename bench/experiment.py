"""Experimentation throughput: many LoRA configs compared chunk by chunk vs one after another.

The experiment profile (default jobs/configs/experiment_smollm2.yaml: SmolLM2-135M with LoRA,
4 learning rates x 2 ranks = 8 configs, the sample data in 4 chunks, held-out rows) four ways,
in one run, on the same Ray cluster, with the same slots:
  1. sequential: each config alone, one after another (an experiment of one config each, so the
     same training code, chunks and seeds; each one pays its own start: data, slot, model load,
     as a sequence of jobs does);
  2. chunked: all configs side by side (`policy: none`): every config trains chunk 1 before any
     trains chunk 2;
  3. successive_halving (eta 2, from chunk 1): the best half goes on at every boundary;
  4. tune_asha (unless --no-tune): Ray Tune, one trial per config under the ASHA scheduler (grace
     1 chunk, reduction factor 2, max_concurrent_trials = slots), each trial a function running
     this project's chunk step (experiments/slot.py) on the same chunks and held-out rows and
     reporting the score after every chunk; its time to the grid's best final score vs
     successive halving's.
Reported, from the records' `at_s` (seconds since the start of the experiment that trained them;
the sequential runs' offsets add up):
  - time until every config has a held-out score: chunked vs sequential;
  - time to reach the sequential grid's best final held-out score: successive halving vs
    sequential (the grid in its expansion order), and vs Ray Tune ASHA;
  - swap share of slot time (chunked run), config-chunks per hour.
2 nodes vs 1 is bench/experiment_nodes.py; co-batching is bench/cobatch.py.

    python bench/experiment.py [--profile P] [--rows 128] [--max-length 128] [--eval-rows 32]
                               [--slots 1] [--no-tune] [--out bench/results/experiment.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def say(msg: str) -> None:
    print(f"[bench experiment] {msg}", flush=True)


def common(args, out: str, name: str) -> dict:
    return {"run.output_dir": out, "run.name": name, "experiment.rows": args.rows,
            "experiment.eval_rows": args.eval_rows, "data.max_length": args.max_length,
            "experiment.num_slots": args.slots, "experiment.tracking": "none"}


def scores(summary: dict, offset: float = 0.0) -> list[dict]:
    return [{"id": c["id"], "values": c["values"], "chunk": h["chunk"], "score": h["score"],
             "at_s": offset + h["at_s"], "busy_s": h["train_s"] + h["eval_s"] + h["swap_in_s"] + h["swap_out_s"]}
            for c in summary["configs"] for h in c["history"]]


def tune_asha(args, exp, work: str) -> dict:
    """The same configs as Ray Tune trials under ASHA, with the same slots: each trial is one
    function (a driver function per trial, as Train V2 recommends) that starts its own slot process
    state (this project's chunk step, `experiments/slot.py`: same chunks, same eval rows, same
    training code) and reports the held-out score after every chunk; ASHA stops trials at rungs."""
    from omegaconf import OmegaConf
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from rapidfire_ray.config import load_config
    from rapidfire_ray.experiments.driver import _Data
    from rapidfire_ray.experiments.slot import Slot, steps_for
    from rapidfire_ray.experiments.spec import load_experiment

    t0 = time.time()  # as an experiment's at_s: from its start, data preparation included
    plan = load_experiment(args.profile, common(args, work, "tune"))
    cands = {c.id: c for c in plan.candidates if c.error is None}
    data = _Data(plan, load_config(plan.base, {"scaling.num_workers": 1}))
    spec = plan.spec
    cfgs = {cid: OmegaConf.to_container(c.cfg, resolve=True) for cid, c in cands.items()}

    def trial(config, chunks, eval_rows):
        cfg = cfgs[config["cid"]]
        slot = Slot(cfg["model"]["name"], max(1, int(spec.resources.cpus)), spec.resources.gpus > 0)
        total = sum(steps_for(len(c), cfg) for c in chunks)
        state = None
        for k, rows in enumerate(chunks):
            record, state = slot.train_chunk(cfg, state, rows, eval_rows, total, None)
            tune.report({"score": record[spec.metric], "chunk": k + 1, "at_s": time.time() - t0,
                         "busy_s": record["train_s"] + record["eval_s"] + record["swap_in_s"] + record["swap_out_s"]})

    trainable = tune.with_resources(tune.with_parameters(trial, chunks=data.chunks, eval_rows=data.eval_rows),
                                    {"cpu": spec.resources.cpus, "gpu": spec.resources.gpus})
    tuner = tune.Tuner(
        trainable, param_space={"cid": tune.grid_search(list(cands))},
        tune_config=tune.TuneConfig(metric="score", mode="min", max_concurrent_trials=args.slots,
                                    scheduler=ASHAScheduler(time_attr="chunk", max_t=spec.num_chunks,
                                                            grace_period=1, reduction_factor=2)),
        run_config=tune.RunConfig(storage_path=os.path.join(work, "tune"), name="asha", verbose=0))
    grid = tuner.fit()
    records, stopped = [], 0
    for result in grid:
        cid = result.config["cid"]
        history = result.metrics_dataframe
        rows = history.to_dict("records") if history is not None else []
        stopped += bool(rows) and rows[-1]["chunk"] < spec.num_chunks
        records += [{"id": f"tune-{cid}", "values": cands[cid].values, "chunk": int(r["chunk"]), "score": r["score"],
                     "at_s": r["at_s"], "busy_s": r["busy_s"]} for r in rows]
    return {"records": sorted(records, key=lambda r: r["at_s"]), "stopped_early": stopped,
            "config_chunks": len(records)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=os.path.join(REPO, "jobs", "configs", "experiment_smollm2.yaml"))
    p.add_argument("--rows", type=int, default=128, help="training rows (cut into the profile's chunks)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--eval-rows", type=int, default=32)
    p.add_argument("--slots", type=int, default=1, help="training slots, the same for every way")
    p.add_argument("--tune", action=argparse.BooleanOptionalAction, default=True,
                   help="also Ray Tune with ASHA over the same configs and slots (--no-tune: skip)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "experiment.json"))
    args = p.parse_args()

    import rapidfire_ray
    from rapidfire_ray.experiments.spec import load_experiment

    work = tempfile.mkdtemp(prefix="bench-experiment-")
    try:
        exp = load_experiment(args.profile, common(args, work, "plan"))
        configs = [c.values for c in exp.candidates if c.error is None]
        say(f"{len(configs)} configs from {args.profile}, {exp.spec.num_chunks} chunks of ~{args.rows // exp.spec.num_chunks}"
            f" rows, {args.eval_rows} held-out rows, {args.slots} slot(s)")
        runs = {}

        say("sequential: each config alone, one after another")
        seq, offset, seq_wall = [], 0.0, 0.0
        for i, values in enumerate(configs):
            over = {**common(args, work, f"seq{i}"), "experiment.policy": "none"}
            over.update({f"experiment.search.{k}": [v] for k, v in values.items()})
            t = time.time()
            summary = rapidfire_ray.experiment(args.profile, overrides=over)
            wall = time.time() - t
            rows = scores(summary, offset)
            for r in rows:
                r["id"] = f"seq{i}"
            seq += rows
            offset += wall
            seq_wall += wall
            say(f"  config {i + 1}/{len(configs)} {values}: {wall:.1f} s, final score {rows[-1]['score']:.4f}")
        runs["sequential"] = {"wall_s": round(seq_wall, 2), "records": seq}

        for name, policy in (("chunked", "none"), ("successive_halving", "successive_halving")):
            say(f"{name}: all configs side by side (policy {policy})")
            over = {**common(args, work, name), "experiment.policy": policy, "experiment.eta": 2,
                    "experiment.min_chunks": 1}
            t = time.time()
            summary = rapidfire_ray.experiment(args.profile, overrides=over)
            runs[name] = {"wall_s": round(time.time() - t, 2), "records": scores(summary), "swap": summary["swap"],
                          "cuts": summary["cuts"], "config_chunks": summary["config_chunks"]}
            say(f"  {runs[name]['wall_s']} s, {summary['config_chunks']} config-chunks, swap "
                f"{100 * summary['swap']['fraction']:.1f}% of slot time")
        if args.tune:
            say("tune_asha: Ray Tune, one trial per config, ASHA scheduler (grace 1 chunk, reduction 2)")
            t = time.time()
            runs["tune_asha"] = tune_asha(args, exp, work)
            runs["tune_asha"]["wall_s"] = round(time.time() - t, 2)
            say(f"  {runs['tune_asha']['wall_s']} s, {len(runs['tune_asha']['records'])} config-chunks, "
                f"{runs['tune_asha']['stopped_early']} trial(s) stopped early")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    num_chunks = exp.spec.num_chunks
    n = len(configs)

    def all_scored(records):
        firsts = {}
        for r in records:
            if r["chunk"] == 1:
                firsts[r["id"]] = min(firsts.get(r["id"], r["at_s"]), r["at_s"])
        return max(firsts.values()) if len(firsts) == n else None

    finals = [r for r in runs["sequential"]["records"] if r["chunk"] == num_chunks]
    target = min(r["score"] for r in finals)
    best = min(finals, key=lambda r: r["score"])

    def reached(records):
        hit = [r["at_s"] for r in records if r["score"] <= target + 1e-9]
        return min(hit) if hit else None

    seq_all, chunk_all = all_scored(runs["sequential"]["records"]), all_scored(runs["chunked"]["records"])
    seq_best, sh_best = reached(runs["sequential"]["records"]), reached(runs["successive_halving"]["records"])
    tune_best = reached(runs["tune_asha"]["records"]) if "tune_asha" in runs else None
    sh_final = min((r["score"] for r in runs["successive_halving"]["records"] if r["chunk"] == num_chunks),
                   default=None)
    result = {
        "benchmark": "experiment", "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "settings": vars(args), "configs": configs, "num_chunks": num_chunks,
        "time_all_scored_s": {"sequential": seq_all, "chunked": chunk_all,
                              "speedup": round(seq_all / chunk_all, 2) if seq_all and chunk_all else None},
        "time_to_best_s": {"target_score": target, "best_config": best["values"], "sequential": seq_best,
                           "successive_halving": sh_best, "successive_halving_final_best": sh_final,
                           "speedup": round(seq_best / sh_best, 2) if seq_best and sh_best else None,
                           "target_4x_met": bool(seq_best and sh_best and seq_best / sh_best >= 4),
                           "tune_asha": tune_best,
                           "speedup_vs_tune_asha": round(tune_best / sh_best, 2) if tune_best and sh_best else None},
        "swap_fraction_chunked": runs["chunked"]["swap"]["fraction"],
        "config_chunks_per_hour": {k: round(3600 * len(v["records"]) / v["wall_s"], 1) for k, v in runs.items()},
        # slot time training, scoring and swapping (each experiment's start-up left out)
        "slot_busy_s": {k: round(sum(r["busy_s"] for r in v["records"]), 2) for k, v in runs.items()},
        "wall_s": {k: v["wall_s"] for k, v in runs.items()},
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    t = result["time_all_scored_s"]
    b = result["time_to_best_s"]
    say(f"every config scored: sequential {t['sequential']:.1f} s, chunked {t['chunked']:.1f} s ({t['speedup']}x)")
    say(f"best final score {target:.4f} ({best['values']}): sequential at {seq_best:.1f} s, successive halving at "
        + (f"{sh_best:.1f} s ({b['speedup']}x)" if sh_best else f"never (its best final {sh_final})"))
    if "tune_asha" in runs:
        say("Ray Tune ASHA: " + (f"reached it at {tune_best:.1f} s; successive halving "
                                 f"{b['speedup_vs_tune_asha']}x faster" if tune_best and sh_best else
                                 f"reached it at {tune_best}, successive halving at {sh_best}"))
    say(f"swap {100 * result['swap_fraction_chunked']:.1f}% of slot time (chunked); config-chunks per hour "
        f"{result['config_chunks_per_hour']}")
    say(f"wall: {result['wall_s']}; slot busy (start-ups left out): {result['slot_busy_s']}")
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
