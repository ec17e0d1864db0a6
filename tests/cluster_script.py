"""Running a test file as a script in a subprocess, for tests that start their own multi-node
`ray.cluster_utils.Cluster` (the session shares one embedded Ray instance, conftest.py): a short
Ray temp dir of its own, SIGTERM on timeout (the script shuts its cluster down in `finally`)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.paths import REPO


def run_cluster_script(script: str, args: list[str], *, prefix: str, timeout: float, what: str) -> str:
    """Run `script args` with its own RAY_TMPDIR; its output. Fails the test on a timeout or a non-zero exit."""
    ray_tmp = tempfile.mkdtemp(prefix=prefix)  # short: Ray's socket paths must stay under 108 chars
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_ADDRESS": "",
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, script, *args], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the script shuts its cluster down before exiting
        try:
            log, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
        pytest.fail(f"{what} timed out:\n{log[-4000:]}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, log[-6000:]
    return log
