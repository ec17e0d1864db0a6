"""Secure defaults: secrets from the environment never printed or written; checkpoints loaded
with weights_only torch loading (or safetensors) only."""
from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "rapidfire_ray")
TINY = os.path.join(REPO, "jobs", "configs", "tiny.yaml")
SECRET = "hf_TESTsecret0123456789abcdef"
WANDB = "wandbTESTkey9876543210fedcba"


def test_secret_values_are_taken_from_secret_named_variables_only():
    from rapidfire_ray.secrets import secret_values

    env = {"HF_TOKEN": SECRET, "WANDB_API_KEY": WANDB, "TOKENIZERS_PARALLELISM": "false-false-false",
           "RAY_AUTH_TOKEN_PATH": "/home/me/.ray/auth_token", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEEXAMPLE",
           "AWS_SECRET_ACCESS_KEY": "aws/secret/EXAMPLE0000", "MY_PASSWORD": "short", "PATH": "/usr/bin:/bin"}
    assert sorted(secret_values(env)) == sorted([SECRET, WANDB, "aws/secret/EXAMPLE0000"])


def test_redaction_of_objects_and_streams(monkeypatch):
    from rapidfire_ray.secrets import MASK, RedactingStream, redact

    monkeypatch.setenv("HF_TOKEN", SECRET)
    doc = {"model": f"https://user:{SECRET}@hub/x", "n": 3, "list": [SECRET, 1.5], SECRET: None}
    assert redact(doc) == {"model": f"https://user:{MASK}@hub/x", "n": 3, "list": [MASK, 1.5], MASK: None}
    out = io.StringIO()
    stream = RedactingStream(out, [SECRET])
    stream.write("token=" + SECRET[:5])  # a value split across writes is still masked
    stream.write(SECRET[5:] + " done\npartial " + SECRET)
    stream.flush()
    assert out.getvalue() == f"token={MASK} done\npartial {MASK}"


def test_package_loads_torch_files_with_weights_only_and_never_unpickles():
    """Every torch.load in the package passes weights_only=True; no pickle/dill loads; and the
    pinned transformers reads a resumed checkpoint's torch files the same way."""
    offenders = []
    for root, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                fn = ast.unparse(node.func)
                if fn.endswith("torch.load"):
                    kw = {k.arg: k.value for k in node.keywords}
                    if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                        offenders.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {ast.unparse(node)}")
                if fn in ("pickle.load", "pickle.loads", "dill.load", "dill.loads", "cloudpickle.load",
                          "cloudpickle.loads", "joblib.load"):
                    offenders.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []
    import inspect

    from transformers import Trainer

    for method in ("_load_rng_state", "_load_optimizer_and_scheduler"):
        src = inspect.getsource(getattr(Trainer, method))
        calls = src.count("torch.load(")
        assert calls and src.count("weights_only=True") >= calls, method


def test_a_pickle_payload_in_a_checkpoint_file_is_refused(tmp_path):
    """What a weights_only load does with a checkpoint file carrying code: refuses it, runs nothing."""
    import pickle

    import torch

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "comm_state_rank0.pt"
    with open(path, "wb") as f:
        pickle.dump({"state": Payload()}, f)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert not marker.exists()


@pytest.mark.slow
def test_a_run_prints_and_writes_no_secret(tmp_path):
    """HF_TOKEN and WANDB_API_KEY in the environment, and the token even in the data path: the
    driver's output, run_summary.json, steps.jsonl and `rapidfire config` show *** instead."""
    data_dir = tmp_path / f"data-{SECRET}"
    data_dir.mkdir()
    with open(os.path.join(REPO, "jobs", "data", "sft_sample.jsonl")) as src:
        (data_dir / "train.jsonl").write_text("".join(src.readlines()[:64]))
    env = {**os.environ, "HF_TOKEN": SECRET, "WANDB_API_KEY": WANDB}
    env.pop("RAY_ADDRESS", None)
    args = ["--profile", TINY, f"data.path={data_dir}", f"run.output_dir={tmp_path / 'out'}", "train.max_steps=1",
            "checkpoint.every_steps=0", "scaling.num_workers=1"]
    shown = subprocess.run([sys.executable, "-m", "rapidfire_ray", "config", *args], env=env, capture_output=True,
                           text=True, timeout=120, cwd=REPO)
    assert shown.returncode == 0 and "data-***" in shown.stdout and SECRET not in shown.stdout
    proc = subprocess.run([sys.executable, "-m", "rapidfire_ray", "train", *args], env=env, capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data-***" in proc.stdout
    for text in (proc.stdout, proc.stderr):
        assert SECRET not in text and WANDB not in text
    run_dir = tmp_path / "out" / "tiny"
    summary = (run_dir / "run_summary.json").read_text()
    assert SECRET not in summary and json.loads(summary)["steps"] == 1
    for root, _dirs, files in os.walk(run_dir):
        for name in files:
            if name.endswith((".json", ".jsonl", ".yaml", ".txt")):
                text = open(os.path.join(root, name), errors="replace").read()
                assert SECRET not in text and WANDB not in text, name
