"""Every failure explained, nothing lost: a run that cannot fit this machine is refused before
anything starts; a failed, interrupted or half-exported run ends with our lines (what failed, the
last checkpoint, the --resume command) and leaves run_summary.json (with its status) and
steps.jsonl; data files that cannot fit data.format fail before Ray starts."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from paths import REPO, TINY_PROFILE


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RAPIDFIRE_LOG_LEVEL", "RAY_ADDRESS")}
    return {**env, "PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", ""), **extra}


def _pids_with(marker: str) -> list[int]:
    """Processes whose environment holds `marker` (a run's processes, Ray's included, inherit it)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


# --------------------------------------------------------------------------------------------
# the embedded cluster's size


def test_a_run_that_cannot_fit_this_machine_is_refused_in_one_line_before_anything_starts(tmp_path):
    marker = f"RF_TEST_RUN={uuid.uuid4().hex}"
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "rapidfire_ray", "train", "--profile", TINY_PROFILE,
                           "scaling.num_workers=64", f"run.output_dir={tmp_path}"], cwd=REPO,
                          env=_env(RAY_TMPDIR=str(ray_tmp), RF_TEST_RUN=marker.split("=")[1]),
                          capture_output=True, text=True, timeout=120)
    took = time.time() - t0
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("rapidfire: error: scaling: 64 worker(s) x 1 CPU(s) = 64 CPUs needed, this machine "
                               "has "), lines
    assert "scaling.num_workers" in lines[0] and "scaling.cpus_per_worker" in lines[0] and "--address" in lines[0]
    assert took < 10, f"refused after {took:.1f} s"
    assert not os.listdir(ray_tmp) and not _pids_with(marker)  # no Ray session, no process left
    assert not (tmp_path / "tiny").exists()


def test_embedded_cluster_size_and_the_share_of_each_reservation(monkeypatch):
    from rapidfire_ray import capacity
    from rapidfire_ray.config import load_config
    from rapidfire_ray.errors import RapidfireError

    here = capacity.machine_cpus()
    assert 1 <= here <= (os.cpu_count() or here) and here <= len(os.sched_getaffinity(0))
    monkeypatch.setattr(capacity, "machine_cpus", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(capacity, "_joins_a_cluster", lambda address: bool(address))
    tiny = load_config(TINY_PROFILE, {})
    capacity.check_fits_here(tiny)  # the default: 2 workers x 1 CPU on 2 cores
    assert capacity.fit_scale(tiny, 0.0, 2) == 0.5  # workers share one CPU, one kept for Ray Data
    assert capacity.fit_scale(tiny, 1.0, 2) == pytest.approx(1 / 3)  # + an RL reward actor
    ps = load_config(TINY_PROFILE, {"communication.mode": "parameter_server"})
    assert capacity.fit_scale(ps, 0.0, 2) == pytest.approx(1 / 2.25)
    assert capacity.fit_scale(tiny, 1.0, 8) == 1.0  # fits as asked
    with pytest.raises(RapidfireError, match=r"3 worker\(s\) x 1 CPU\(s\) = 3 CPUs needed, this machine has 2"):
        capacity.check_fits_here(load_config(TINY_PROFILE, {"scaling.num_workers": 3}))
    with pytest.raises(RapidfireError, match=r"2 worker\(s\) x 2 CPU\(s\) = 4 CPUs"):
        capacity.check_fits_here(load_config(TINY_PROFILE, {"scaling.cpus_per_worker": 2}))
    capacity.check_fits_here(load_config(TINY_PROFILE, {"scaling.num_workers": 64}), address="10.0.0.1:6379")


# --------------------------------------------------------------------------------------------
# what failed


def test_the_failed_rank_and_the_meaningful_line_of_its_error():
    from ray.train import WorkerGroupError

    from rapidfire_ray.driver.failure import describe_failure, first_meaningful_line, resume_command, set_command
    from rapidfire_ray.errors import RunFailed

    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    raise ValueError('bad lr')\n"
          "ValueError: bad lr\n")
    assert first_meaningful_line(RuntimeError(tb)) == "ValueError: bad lr"
    died = RuntimeError("The actor died unexpectedly before finishing this task.\n\tclass_name: RayTrainWorker\n"
                        "\tpid: 123\n\tip: 10.0.0.7\nThe actor is dead because its worker process has died.")
    err = WorkerGroupError("worker errors", {1: died, 0: RuntimeError(tb)})
    try:
        try:
            raise err
        except WorkerGroupError as e:
            raise RunFailed("training failed: Training failed due to worker errors:") from e
    except RunFailed as e:
        text = describe_failure(e)
    assert text == ("rank 0: ValueError: bad lr; rank 1 (node 10.0.0.7, pid 123): RuntimeError: The actor died "
                    "unexpectedly before finishing this task.")
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    lost = WorkerHealthCheckFailedError("A worker health check failed.", died)
    assert describe_failure(WorkerGroupError("x", {1: lost})) == (
        "rank 1 (node 10.0.0.7, pid 123): worker process lost (RuntimeError: The actor died unexpectedly before "
        "finishing this task.)")
    set_command(["train", "--profile", "p.yaml", "train.max_steps=5"])
    assert resume_command().endswith("train --profile p.yaml train.max_steps=5 --resume")
    set_command(["train", "--resume", "--profile", "p.yaml"])
    assert resume_command().endswith("train --resume --profile p.yaml")


def _summary(run_dir):
    return json.loads((run_dir / "run_summary.json").read_text())


def _steps(run_dir):
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_crashed_worker_with_no_retries_leaves_its_summary_and_the_resume_command(ray_cluster, tmp_path, capsys,
                                                                                  monkeypatch):
    from rapidfire_ray.config import load_config
    from rapidfire_ray.driver import failure, run
    from rapidfire_ray.errors import RunFailed
    from rapidfire_ray.faults import CRASH

    monkeypatch.setenv(CRASH, "sft:4")  # rank 0 raises InjectedCrash as step 4 starts
    monkeypatch.setattr(failure, "_command", ["train", "--profile", "tiny.yaml", f"run.output_dir={tmp_path}"])
    with pytest.raises(RunFailed) as e:
        run(load_config(TINY_PROFILE, {"run.output_dir": str(tmp_path), "train.max_steps": 6,
                                       "checkpoint.every_steps": 2, "scaling.max_failures": 0}))
    msg = str(e.value)
    assert msg.startswith("training failed: rank 0: InjectedCrash: injected crash at step 4"), msg
    assert msg.endswith(f"to continue: python -m rapidfire_ray train --profile tiny.yaml run.output_dir={tmp_path} "
                        "--resume") or msg.endswith(f"run.output_dir={tmp_path} --resume"), msg
    run_dir = tmp_path / "tiny"
    s = _summary(run_dir)
    assert s["status"] == "failed" and "InjectedCrash: injected crash at step 4" in s["error"]
    assert s["steps_trained"] == s["steps"] == 3 and s["model_dir"] is None
    assert s["last_checkpoint"].endswith("checkpoint-00000002") and s["last_checkpoint_step"] == 2
    assert s["steps_since_checkpoint"] == 1
    assert sorted({r["step"] for r in _steps(run_dir)}) == [1, 2, 3]
    out = capsys.readouterr().out
    assert "[rapidfire] warning: run failed: rank 0: InjectedCrash" in out
    assert f"[rapidfire] last checkpoint: {run_dir}/checkpoint-00000002 (step 2; 1 step(s)" in out


@pytest.mark.slow
def test_a_failed_model_export_still_writes_the_summary_and_says_what_to_free(ray_cluster, tmp_path, capsys,
                                                                            monkeypatch):
    import importlib

    from rapidfire_ray.config import load_config
    from rapidfire_ray.errors import RunFailed

    run_module = importlib.import_module("rapidfire_ray.driver.run")

    def disk_full(cfg, checkpoint_dir, model_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_module, "export_final", disk_full)
    with pytest.raises(RunFailed, match="exporting the model failed \\(No space left on device\\)"):
        run_module.run(load_config(TINY_PROFILE, {"run.output_dir": str(tmp_path), "train.max_steps": 2,
                                                  "checkpoint.every_steps": 2}))
    run_dir = tmp_path / "tiny"
    s = _summary(run_dir)
    assert s["status"] == "failed" and "No space left on device" in s["error"] and s["model_dir"] is None
    assert s["steps"] == 2 and s["last_checkpoint"].endswith("checkpoint-00000002")
    assert s["steps_since_checkpoint"] == 0 and len(_steps(run_dir)) == 4
    out = capsys.readouterr().out
    assert "MiB free on the filesystem of" in out and "free space there" in out


@pytest.mark.slow
def test_ctrl_c_stops_the_run_with_its_summary_and_leaves_no_process(tmp_path):
    """SIGINT to a CLI run mid-training (its own embedded cluster): exit 130, "interrupted at step
    N" and the resume command, a summary with status interrupted, and none of its processes left."""
    from rapidfire_ray.faults import DATA_DELAY as DATA_DELAY_ENV

    token = uuid.uuid4().hex
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rapidfire_ray", "train", "--profile", TINY_PROFILE,
                                 f"run.output_dir={tmp_path}", "train.max_steps=200", "checkpoint.every_steps=2"],
                                cwd=REPO, env=_env(**{DATA_DELAY_ENV: "0.3", "RF_TEST_RUN": token}),
                                stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.time() + 480
            run_dir = tmp_path / "tiny"
            while time.time() < deadline and proc.poll() is None and not (run_dir / "checkpoint-00000002").is_dir():
                time.sleep(0.5)
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(2)
            t0 = time.time()
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=120)
            stopped = time.time() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
    out = log_path.read_text()
    assert rc == 130, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("rapidfire: interrupted at step "), out[-3000:]
    assert last.endswith("--resume") and "to continue: " in last, last
    s = _summary(run_dir)
    assert s["status"] == "interrupted" and s["steps"] >= 2 and s["last_checkpoint"] is not None
    assert f"interrupted at step {s['steps']}" in last
    assert _steps(run_dir)
    deadline = time.time() + 30
    while _pids_with(f"RF_TEST_RUN={token}") and time.time() < deadline:
        time.sleep(1)
    assert not _pids_with(f"RF_TEST_RUN={token}")
    print(f"\nSIGINT -> exit in {stopped:.1f} s, at step {s['steps']}")


# --------------------------------------------------------------------------------------------
# data checks before Ray


def test_data_files_that_cannot_fit_the_format_fail_before_ray(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rapidfire_ray.data.precheck import check_data_files
    from rapidfire_ray.errors import RapidfireError

    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), tmp_path / "qa.parquet")
    with pytest.raises(RapidfireError) as e:
        check_data_files(str(tmp_path / "qa.parquet"), "prompt_completion")
    assert str(e.value) == (f"data.path file {tmp_path / 'qa.parquet'}: data.format 'prompt_completion' expects "
                            "columns [prompt, completion], found [question, answer] (missing [prompt, completion]); "
                            "rename the columns to [prompt, completion] or choose the data.format of this file")
    pq.write_table(pa.table({"text": ["hello"]}), tmp_path / "t.parquet")
    with pytest.raises(RapidfireError, match=r"found \[text\] .*set data.format to 'text'"):
        check_data_files(str(tmp_path / "t.parquet"), "prompt_completion")
    assert check_data_files(str(tmp_path / "t.parquet"), "text") == [str(tmp_path / "t.parquet")]
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(RapidfireError, match="none.parquet: the Parquet file has no rows"):
        check_data_files(str(tmp_path / "none.parquet"), "text")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(RapidfireError, match="broken.parquet: not a readable Parquet file"):
        check_data_files(str(tmp_path / "broken.parquet"), "text")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(RapidfireError, match=r"empty.jsonl: the file is empty \(0 bytes\)"):
        check_data_files(str(tmp_path / "empty.jsonl"), "text")
    (tmp_path / "blank.jsonl").write_text("\n\n  \n")
    with pytest.raises(RapidfireError, match="blank.jsonl: the file has no rows"):
        check_data_files(str(tmp_path / "blank.jsonl"), "text")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": []}) + "\n")
    with pytest.raises(RapidfireError, match=r"expects columns \[text\], found \[messages\].*'messages'"):
        check_data_files(str(tmp_path / "chat.jsonl"), "text")
    # rows that are not JSON objects are left to the row-level report (data.on_bad_row)
    (tmp_path / "rows.jsonl").write_text("not json\n")
    assert check_data_files(str(tmp_path / "rows.jsonl"), "text")


def test_the_cli_refuses_bad_columns_before_ray_starts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), tmp_path / "qa.parquet")
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "rapidfire_ray", "train", "--profile", TINY_PROFILE,
                           f"data.path={tmp_path / 'qa.parquet'}", f"run.output_dir={tmp_path}"], cwd=REPO,
                          env=_env(RAY_TMPDIR=str(ray_tmp)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "expects columns [prompt, completion], found [question, answer]" in lines[0], lines
    assert not os.listdir(ray_tmp)
