"""The package's one logger, and what a run prints by default.

Our own lines go through `say` / `warn` (logger `rapidfire`, `[rapidfire] ...` on stdout). By
default the libraries' INFO chatter is hidden: Ray's, Ray Data's and Ray Train's log lines and
progress bars, transformers' and DeepSpeed's messages, and the per-worker weight-loading and
shard-writing bars. `rapidfire --verbose ...` or `RAPIDFIRE_LOG_LEVEL=DEBUG` (or INFO) shows
everything. Warnings and errors of every library still reach the user, and a worker's error
arrives in full through Ray Train's exception.
"""
from __future__ import annotations

import logging
import os
import sys

LEVEL_ENV = "RAPIDFIRE_LOG_LEVEL"
logger = logging.getLogger("rapidfire")

# Libraries whose INFO lines a default run hides (their warnings stay).
CHATTY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune", "ray.serve", "transformers", "datasets",
                  "DeepSpeed", "deepspeed", "torch.distributed", "accelerate", "filelock", "urllib3", "httpx")

# For the worker processes (Ray Train workers, Ray Data tasks, actors) of a quiet run.
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",  # transformers' "Loading weights" / "Writing model shards" bars
    "DS_LOG_LEVEL": "warning",
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING and not msg.startswith(("warning", "error")):
            msg = f"warning: {msg}"
        return f"[rapidfire] {msg}"


class _Stdout(logging.StreamHandler):
    """Writes to sys.stdout as it is at each line (pytest's capture, contextlib.redirect_stdout,
    the secret-redacting wrapper), not the one there was at import."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _handler() -> logging.Handler:
    h = _Stdout()
    h.setFormatter(_Format())
    h.set_name("rapidfire")
    return h


if not logger.handlers:
    logger.addHandler(_handler())
    logger.setLevel(logging.INFO)
    logger.propagate = False


def say(msg: str) -> None:
    """One line of ours for the user: what runs, progress, the result."""
    logger.info(msg)
    for h in logger.handlers:
        h.flush()


def warn(msg: str) -> None:
    logger.warning(msg)
    for h in logger.handlers:
        h.flush()


def verbose() -> bool:
    """True when the user asked for the libraries' own output too."""
    return os.environ.get(LEVEL_ENV, "").upper() in ("DEBUG", "INFO")


def set_verbose(on: bool) -> None:
    """`--verbose`: show everything (also in the workers, which read the environment)."""
    if on:
        os.environ[LEVEL_ENV] = "DEBUG"
    quiet_libraries()


def worker_env() -> dict[str, str]:
    """Environment for the run's worker processes: quiet by default, the user's level with --verbose."""
    if verbose():
        return {LEVEL_ENV: os.environ[LEVEL_ENV], "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
                "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    return dict(QUIET_ENV)


def quiet_libraries() -> None:
    """Hide the libraries' INFO chatter in this process (driver or worker) unless verbose. Also
    sets QUIET_ENV for processes started from here (an embedded Ray cluster's workers inherit it)."""
    if verbose():
        return
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.enable_operator_progress_bars = False
        ctx.print_on_execution_start = False
    except Exception:  # noqa: BLE001 - an older Ray without these switches: its lines stay
        pass
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001
        pass
