"""A run that fails or is interrupted still ends with our own lines and its outputs: what failed
(the first meaningful line of the worker's error, its rank and node), the last complete
checkpoint on disk, the command that continues it, and `run_summary.json` / `steps.jsonl` with
`status: failed|interrupted`."""
from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import sys

from ..errors import RunFailed

# The command line of this process (`rapidfire train ...`), set by the CLI; the resume hint adds
# --resume to it. None when the run was started from Python (rapidfire_ray.train).
_command: list[str] | None = None
# Set while run_pipeline runs its stages: the pipeline's --resume continues any stage.
in_pipeline = False


class RunInterrupted(RunFailed):
    """Ctrl-C (SIGINT) stopped the run. CLI exit code 130."""


def set_command(argv: list[str]) -> None:
    global _command
    _command = list(argv)


def resume_command() -> str:
    """The same command line with --resume added (once)."""
    if _command is None:
        return "the same rapidfire_ray.train(...) call with resume=True (or `rapidfire train ... --resume`)"
    prog = "rapidfire" if os.path.basename(sys.argv[0] or "") == "rapidfire" else "python -m rapidfire_ray"
    argv = _command if "--resume" in _command else [*_command, "--resume"]
    return f"{prog} {shlex.join(argv)}"


# --------------------------------------------------------------------------------------------
# what failed

_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Crash|Interrupt|Exit|Failure|Warning)\w*)(: |$)")
_NOISE = ("Traceback", "File ", "During handling", "The above exception", "ray::", "^", "~")


def first_meaningful_line(exc: BaseException) -> str:
    """The line that says what went wrong: the innermost `SomeError: message` line of a
    traceback carried in the message, else the message's first non-blank line, else the type."""
    text = str(exc)
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    errors = [ln.strip() for ln in lines if not ln.startswith((" ", "\t")) and _EXC_LINE.match(ln.strip())
              and not ln.strip().startswith(("ray.exceptions.RayTaskError", "RayTaskError"))]
    if errors:
        line = errors[-1]
    else:
        plain = [ln.strip() for ln in lines if not ln.strip().startswith(_NOISE)]
        line = plain[0] if plain else ""
    if not line:
        return type(exc).__name__
    if not _EXC_LINE.match(line) and type(exc).__name__ not in line:
        line = f"{type(exc).__name__}: {line}"
    return line[:300]


def _where(exc: BaseException) -> str:
    """' (node IP, pid N)' where Ray's error names them (a dead worker's ActorDiedError does)."""
    text = str(exc)
    ip = re.search(r"\bip[=:]\s*([0-9a-fA-F.:]+)", text)
    pid = re.search(r"\bpid[=:]\s*(\d+)", text)
    parts = ([f"node {ip.group(1).rstrip(',.:')}"] if ip else []) + ([f"pid {pid.group(1)}"] if pid else [])
    return f" ({', '.join(parts)})" if parts else ""


def _rank_error(err: BaseException) -> str:
    inner = getattr(err, "health_check_failure", None)  # Ray Train v2: the worker process is gone
    if isinstance(inner, BaseException):
        return f"worker process lost ({first_meaningful_line(inner)})"
    return first_meaningful_line(err)


def describe_failure(exc: BaseException) -> str:
    """One phrase for a failed fit(): each failed rank with its node and its error's meaningful
    line (Ray Train v2's WorkerGroupError.worker_failures), the controller's error, or the error."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for e in chain:
        failures = getattr(e, "worker_failures", None)
        if isinstance(failures, dict) and failures:
            parts = []
            for rank in sorted(failures):
                err = failures[rank]
                parts.append(f"rank {rank}{_where(err)}: {_rank_error(err)}")
            return "; ".join(parts)
        inner = getattr(e, "controller_failure", None)
        if isinstance(inner, BaseException):
            return f"Ray Train controller: {first_meaningful_line(inner)}"
    inner = [e for e in chain if not isinstance(e, RunFailed)]
    return first_meaningful_line(inner[0]) if inner else (str(chain[0]) if chain else "unknown error")


# --------------------------------------------------------------------------------------------
# what is on disk


def last_checkpoint(run_dir: str) -> tuple[str | None, int | None]:
    """The newest checkpoint folder under `run_dir` whose manifests verify, and its step."""
    from ..checkpoints import step_of, verify

    for path in sorted(glob.glob(os.path.join(run_dir, "checkpoint-*")), reverse=True):
        if os.path.isdir(path) and step_of(os.path.basename(path)) is not None:
            try:
                if verify(path) is None:
                    return path, step_of(os.path.basename(path))
            except OSError:
                continue
    return None, None


def folder_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def free_space_hint(run_dir: str, checkpoint: str | None) -> str:
    """What to free after a failed save: the filesystem's free space against the model's size."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return "free disk space where run.output_dir is"
    need = folder_bytes(checkpoint) if checkpoint else 0
    text = f"{free / 2**20:,.0f} MiB free on the filesystem of {run_dir}"
    if need:
        text += f", the model needs about {need / 2**20:,.0f} MiB"
    return text + ": free space there (old runs, old checkpoints: checkpoint.keep) or set run.output_dir elsewhere"


def failure_fields(status: str, error: str, run_dir: str, steps: int | None) -> dict:
    """The summary fields every failed or interrupted run has."""
    ckpt, ckpt_step = last_checkpoint(run_dir)
    return {"status": status, "error": error, "steps_trained": steps, "last_checkpoint": ckpt,
            "last_checkpoint_step": ckpt_step,
            "steps_since_checkpoint": (steps - ckpt_step) if steps is not None and ckpt_step is not None else steps}


def continue_line(resumable: bool, run_dir: str, has_checkpoint: bool) -> str:
    """How to continue: the exact command, or why there is none."""
    if not resumable and not in_pipeline:
        return (f"an RL run cannot be resumed; remove {run_dir} (or choose another run.name) and run the same "
                "command again")
    if not has_checkpoint and not in_pipeline:
        return "no checkpoint was saved, so nothing to resume: run the same command again to start over"
    return f"to continue: {resume_command()}"
