"""The package's one logger, and what a run prints by default.

Our own lines go through `say` / `warn` (logger `rapidfire`, `[rapidfire] ...` on stdout). By
default the libraries' INFO chatter is hidden: Ray's, Ray Data's and Ray Train's log lines and
progress bars, transformers' and DeepSpeed's messages, and the per-worker weight-loading and
shard-writing bars. `rapidfire --verbose ...` or `RAPIDFIRE_LOG_LEVEL=DEBUG` (or INFO) shows
everything. Warnings and errors of every library still reach the user, and a worker's error
arrives in full through Ray Train's exception.
"""
from __future__ import annotations

import functools
import logging
import os
import re
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
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING and not msg.startswith(("warning", "error")):
            msg = f"warning: {msg}"
        return f"[rapidfire] {msg}"


class _Stdout(logging.StreamHandler):
    """Writes to whatever sys.stdout is now (secrets.redact_std_streams replaces it, so do tests)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
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


def ray_logging_level() -> int:
    """`ray.init(logging_level=...)`: Ray's own INFO lines only when verbose."""
    return logging.INFO if verbose() else logging.WARNING


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
        import ray.data  # noqa: F401 - configures the "ray.data" logger; its console handler is tamed below

        for h in logging.getLogger("ray.data").handlers:
            if h.get_name() == "console":  # the ray-data.log file handler keeps everything
                h.setLevel(logging.WARNING)
                if _hide_notices not in h.filters:
                    h.addFilter(_hide_notices)
    except Exception:  # noqa: BLE001 - an older Ray whose logging differs: its lines stay
        pass
    # The notice that an embedded cluster uses token auth, Ray's default (its "disabled" warning stays).
    token_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if _hide_notices not in token_log.filters:
        token_log.addFilter(_hide_notices)
    # Ray Train's v2 modules log by file path (getLogger(__file__)), outside the "ray" tree.
    for name in list(logging.Logger.manager.loggerDict):
        if f"{os.sep}ray{os.sep}" in name:
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        import transformers

        transformers.logging.set_verbosity_warning()
        transformers.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001
        pass


def _hide_notices(record: logging.LogRecord) -> bool:
    # Ray Data's notice that its progress bars are off; Ray's that a new local cluster uses tokens.
    return not record.getMessage().startswith(("Progress bars", "Token authentication is enabled"))


# What a quiet run lets through from its worker processes' output (Ray forwards their stdout and
# stderr line by line): our own lines, errors and tracebacks, and warnings.
_KEEP = re.compile(r"\[rapidfire\]|Traceback|Error|Exception|^\s+(File |raise |\^)|warning", re.IGNORECASE)
# Chatter that matches _KEEP's words all the same: a core worker's note on actor arguments, and the
# raylet's note that it started more worker processes than its start-up concurrency (a run's ~9
# actors and Ray Data's tasks on a small machine; nothing a user can act on).
_DROP = re.compile(r"^\[[\d\- :,]+ [IE] \d+ \d+\] \w+\.cc:\d+: (Actor with class name: '\w+' .* has constructor "
                   r"arguments in the object store)"
                   r"|^WARNING: \d+ PYTHON worker processes have been started on node")


# Ray Train's background actors. With several Ray instances on one host (a test suite beside a
# run) the placement-group cleaner's state queries fail with a traceback every few seconds.
RAY_BACKGROUND_ACTORS = frozenset({"PlacementGroupCleaner"})


def keep_worker_line(line: str) -> bool:
    """Whether a quiet run shows this line of a worker's output."""
    return bool(_KEEP.search(line)) and not _DROP.search(line)


def filter_worker_output() -> None:
    """In this (driver) process, show only `keep_worker_line` lines of the workers' forwarded
    output, unless verbose. Call after `ray.init`; a no-op where Ray forwards nothing."""
    if verbose():
        return
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # Ray moved its internals: everything is shown
        return
    names = [name for name, _ in dispatcher.handlers]
    if "ray_print_logs" not in names:
        return
    dispatcher.remove_handler("ray_print_logs")
    print_to_stdstream = getattr(ray_worker.print_to_stdstream, "_rapidfire_original", ray_worker.print_to_stdstream)
    ignore_prefix = ray_worker._should_ignore_worker_log_prefix(ray_worker.global_worker)
    show = functools.partial(print_to_stdstream, ignore_prefix=ignore_prefix)

    # The raylet's messages to the driver (a worker killed for memory, one that died, its worker
    # pool's start-up note) reach the same printer from Ray's error listener: all but _DROP's.
    def print_raylet_filtered(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet":
            data = {**data, "lines": [line for line in data.get("lines", []) if not _DROP.search(line)]}
            if not data["lines"]:
                return
        print_to_stdstream(data, ignore_prefix=ignore_prefix)

    print_raylet_filtered._rapidfire_original = print_to_stdstream
    ray_worker.print_to_stdstream = print_raylet_filtered

    def filtered(data: dict) -> None:
        if data.get("actor_name") in RAY_BACKGROUND_ACTORS:
            return  # their errors are Ray's own bookkeeping; a run's failure arrives through fit()
        lines, in_traceback = [], False
        for line in data.get("lines", []):
            in_traceback = in_traceback or line.lstrip().startswith("Traceback")
            if in_traceback or keep_worker_line(line):  # a traceback is shown whole
                lines.append(line)
        if lines:
            show({**data, "lines": lines})

    dispatcher.add_handler("ray_print_logs", filtered)
