"""The job entrypoint in jobs/ runs a profile through the Python API, as a user's job would."""
from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
import time

import pytest

from private_head import PrivateHead

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_jobs_train_entrypoint_runs_a_profile(ray_cluster, tmp_path, capsys):
    main = runpy.run_path(os.path.join(REPO, "jobs", "train.py"))["main"]
    rc = main([os.path.join(REPO, "jobs", "configs", "tiny.yaml"), f"run.output_dir={tmp_path}",
               "train.max_steps=2", "checkpoint.every_steps=0", "scaling.num_workers=1"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["steps"] == 2 and printed["stage"] == "sft" and os.path.isdir(printed["model_dir"])
    assert main(["--help"]) == 2


def _wait_job(client, job_id: str, timeout_s: float):
    from ray.job_submission import JobStatus

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status = client.get_job_status(job_id)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return status
        time.sleep(2)
    return client.get_job_status(job_id)


@pytest.mark.slow
def test_ray_job_submit_runs_a_tiny_sft_job_on_a_token_auth_head(tmp_path):
    """`ray job submit` with jobs/runtime_env.yaml (the project installed from the working dir into
    the job's virtualenv) against a head started here with token auth; status and logs come back
    through the job API; the run joined the job's cluster instead of starting its own."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobStatus, JobSubmissionClient

    with PrivateHead(num_cpus=3, dashboard=True) as head:
        out = tmp_path / "out"
        submit = [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", head.dashboard,
                  "--working-dir", ".", "--runtime-env", "jobs/runtime_env.yaml", "--no-wait", "--",
                  "rapidfire", "train", "--profile", "jobs/configs/tiny.yaml", f"run.output_dir={out}",
                  "train.max_steps=2", "checkpoint.every_steps=0"]
        # Without the cluster's token the job API refuses the submission.
        refused = subprocess.run(submit, env={**head.env, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "no-token")},
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0
        proc = subprocess.run(submit, env=head.env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        job_id = re.search(r"Job '([^']+)' submitted successfully", proc.stdout + proc.stderr).group(1)

        client = JobSubmissionClient(head.dashboard, headers=head.headers)
        status = _wait_job(client, job_id, 540)
        logs = client.get_job_logs(job_id)
        assert status == JobStatus.SUCCEEDED, logs[-4000:]
        info = client.get_job_info(job_id)
        assert info.entrypoint.startswith("rapidfire train --profile jobs/configs/tiny.yaml")
        # The driver joined the job's cluster (RAY_ADDRESS set by the job) and never started its own.
        joined = re.search(r"\[rapidfire\] (connected to Ray cluster at \S+|started an embedded.*)", logs)
        assert joined and joined.group(1).endswith(f":{head.port}"), [ln for ln in logs.splitlines()
                                                                      if "rapidfire" in ln][:10]
        assert "embedded local" not in logs
        assert "[rapidfire] done: 2 steps" in logs
        summary = json.loads((out / "tiny" / "run_summary.json").read_text())
        assert summary["steps"] == 2 and summary["num_workers"] == 2
        assert info.runtime_env["pip"]["packages"] == ["${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}"]
        with pytest.raises(AuthenticationError):
            JobSubmissionClient(head.dashboard, headers={"Authorization": "Bearer wrong"}).get_job_status(job_id)
