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
