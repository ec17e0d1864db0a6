"""`--address` joins an existing token-auth Ray cluster (started here with `ray start --head`)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "jobs", "configs", "tiny.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pids_using(marker: str) -> list[int]:
    """Processes of the cluster started with temp dir `marker` (only ours, never other Ray clusters)."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


@pytest.fixture
def head_cluster():
    temp = tempfile.mkdtemp(prefix="rf-head-", dir="/tmp")
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
                    "--num-cpus=3", f"--temp-dir={temp}", "--include-dashboard=false", "--disable-usage-stats"],
                   env=env, check=True, capture_output=True, timeout=180)
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids_using(temp):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(2)


@pytest.mark.slow
def test_train_joins_a_running_cluster_with_token_auth(head_cluster, tmp_path):
    address, env = head_cluster
    proc = subprocess.run([sys.executable, "-m", "rapidfire_ray", "train", "--profile", TINY, "--address", address,
                           f"run.output_dir={tmp_path}", "train.max_steps=2", "checkpoint.every_steps=0"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"connected to Ray cluster at {address}" in proc.stdout
    assert "embedded local" not in proc.stdout
    summary = json.loads((tmp_path / "tiny" / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["num_workers"] == 2


def test_unreachable_address_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rapidfire_ray", "train", "--profile", TINY, "--address",
                           f"127.0.0.1:{free_port()}", f"run.output_dir={tmp_path}"],
                          env={**os.environ, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rapidfire: error: --address") and "could not connect" in last
