"""The package logger: our lines, and which worker lines a quiet run lets through."""
from __future__ import annotations

import logging

from rapidfire_ray import log


def test_say_and_warn_are_ours(capsys):
    log.say("training: stage sft")
    log.warn("something to fix")
    out = capsys.readouterr().out.splitlines()
    assert out == ["[rapidfire] training: stage sft", "[rapidfire] warning: something to fix"]


def test_quiet_run_keeps_our_lines_errors_and_warnings_only():
    keep = log.keep_worker_line
    assert keep("[rapidfire] rank 1: step skipped, non-finite gradient in w")
    assert keep("Traceback (most recent call last):")
    assert keep("ValueError: bad row 3")
    assert keep("UserWarning: something changed")
    assert not keep("Reporting training result 1: TrainingReport(checkpoint=None, metrics={'step': 4}) from rank 0")
    assert not keep("✔️  Dataset dataset_0358_0 execution finished in 2.29 seconds")
    assert not keep("Loading weights: 100%|##########| 3/3 [00:00<00:00, 35.1it/s]")
    assert not keep("[2026-12-04 16:27:23,618 E 5471 5538] core_worker.cc:2465: Actor with class name: "
                    "'PreemptionWatcher' and ID: '03' has constructor arguments in the object store and max_restarts")
    assert not keep("WARNING: 8 PYTHON worker processes have been started on node: 889d7f with address: 192.0.2.2, "
                    "which is 4x the maximum expected startup concurrency (2). This could be a result of using")


def test_quiet_libraries_hides_info_but_not_warnings(monkeypatch):
    monkeypatch.delenv(log.LEVEL_ENV, raising=False)
    log.quiet_libraries()
    for name in ("ray.train", "transformers", "DeepSpeed"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO)
        assert logging.getLogger(name).isEnabledFor(logging.WARNING)
    assert log.worker_env()["TQDM_DISABLE"] == "1"


def test_verbose_shows_everything(monkeypatch):
    monkeypatch.setenv(log.LEVEL_ENV, "DEBUG")
    assert log.verbose()
    env = log.worker_env()
    assert env[log.LEVEL_ENV] == "DEBUG" and "TQDM_DISABLE" not in env


def test_quiet_driver_drops_the_raylets_worker_pool_note_but_not_its_errors(ray_cluster, capsys, monkeypatch):
    """Ray's error listener prints the raylet's messages itself (not through the worker-output
    dispatcher): the quiet filter covers them too."""
    from ray._private import worker as ray_worker

    monkeypatch.delenv(log.LEVEL_ENV, raising=False)
    log.filter_worker_output()
    log.filter_worker_output()  # idempotent: one wrapper, not two
    note = ("WARNING: 10 PYTHON worker processes have been started on node: fae4 with address: 192.0.2.2, "
            "which is 5x the maximum expected startup concurrency (2).")
    oom = "Task was killed due to the node running low on memory."
    ray_worker.print_to_stdstream({"lines": [note], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    ray_worker.print_to_stdstream({"lines": [note, oom], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    out = capsys.readouterr()
    printed = (out.out + out.err).splitlines()
    assert len(printed) == 1 and printed[0].endswith(oom), printed
    assert not hasattr(ray_worker.print_to_stdstream._rapidfire_original, "_rapidfire_original")
