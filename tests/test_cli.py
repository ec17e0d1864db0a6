"""The command line: overrides and flags in any order, and what a default run prints."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import yaml

from paths import REPO, TINY_PROFILE
from rapidfire_ray.cli import _parse, main


def test_overrides_and_flags_in_any_order():
    args = _parse(["train", "--profile", "P", "train.max_steps=8", "--communication", "allreduce",
                   "run.output_dir=D", "--resume", "optimizer.params.lr=1e-4"])
    assert args.command == "train" and args.profile == "P" and args.resume
    assert args.communication == "allreduce"
    assert args.overrides == ["train.max_steps=8", "run.output_dir=D", "optimizer.params.lr=1e-4"]


def test_config_command_takes_overrides_on_both_sides_of_a_flag(capsys):
    assert main(["config", "train.max_steps=3", "--profile", TINY_PROFILE, "optimizer.params.lr=0.002"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["train"]["max_steps"] == 3 and cfg["optimizer"]["params"]["lr"] == 0.002
    assert cfg["run"]["name"] == "tiny"  # from the profile


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--profile", TINY_PROFILE, "--no-such-flag"])
    assert e.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


def test_the_driver_loads_without_the_training_stack():
    """The driver (one per `rapidfire train`) needs Ray, the config and a tokenizer: TRL, PEFT,
    transformers' trainer and model code and the worker loop load in the workers only (about 6 s
    of CPU per run on 2 cores when the driver loaded them too). Ray Train gets the workers' entry
    by reference."""
    code = ("import sys, pickle, cloudpickle, rapidfire_ray.cli, rapidfire_ray.driver, rapidfire_ray.rl.spec\n"
            "from rapidfire_ray.driver.stages import SFTStage\n"
            "from rapidfire_ray.rl.spec import RLStage\n"
            "entries = [SFTStage.loop(None), RLStage.loop(None)]\n"
            "print([len(cloudpickle.dumps(e)) for e in entries])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trl', 'peft', 'deepspeed') or m in "
            "('transformers.trainer', 'transformers.modeling_utils', 'rapidfire_ray.worker.loop', "
            "'rapidfire_ray.rl.worker', 'rapidfire_ray.memory.activations')))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sizes, loaded = proc.stdout.strip().splitlines()[-2:]
    assert loaded == "[]", loaded
    assert all(size < 200 for size in ast.literal_eval(sizes)), sizes  # pickled by reference, not by value


@pytest.mark.slow
def test_default_run_prints_only_our_lines(tmp_path):
    """A 20-step tiny run on an embedded cluster: every line is ours (no Ray, Ray Data, Ray Train,
    transformers or DeepSpeed chatter from the driver or the workers), and few of them."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAPIDFIRE_LOG_LEVEL", "RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-m", "rapidfire_ray", "train", "--profile", TINY_PROFILE,
                           "train.max_steps=20", f"run.output_dir={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    theirs = [line for line in lines if not line.startswith("[rapidfire] ")]
    assert not theirs, "\n".join(theirs[:20])
    assert len(lines) <= 40, "\n".join(lines)
    assert any(line.startswith("[rapidfire] done: 20 steps") for line in lines)
