"""The native (C++) CPU kernels of the 1-bit codec: built on first use, used once built.

`native_codecs.cpp` encodes a flat bucket with error feedback in one pass per chunk (the scale,
the sign bits, the decoded values and the residual from one load of each element) and decodes in
one pass, bit-identical to the reference codec (tests/compression/test_fused.py). Inductor cannot
generate that pass: its reductions sum in an order of its own, so the scale would round
differently from the reference's `pairwise_sum`.

Building takes 20-60 s of one core with the C++ compiler and ninja that `torch.compile` on CPU
needs too; the result is cached per machine and CPU type (`$TORCH_EXTENSIONS_DIR/rapidfire_ray`, by default
`~/.cache/torch_extensions/rapidfire_ray`), so later processes load it in well under a second. `RAPIDFIRE_CODEC_NATIVE`:
- "auto" (default): the first CPU 1-bit encode starts the build in a background thread and the
  compiled kernels of compression/fused.py serve until it is ready (same results, so a switch
  mid-run changes nothing but speed); a failed build warns once and is not retried;
- "off": never built (the compiled or eager kernels only);
- "always": built in the caller's thread, and a failure raises (what the tests use).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

NATIVE_ENV = "RAPIDFIRE_CODEC_NATIVE"
MODES = ("auto", "off", "always")
SOURCE = Path(__file__).with_name("native_codecs.cpp")

_BUILD_TIMEOUT_S = 1800
_lock = threading.Lock()
_module = None
_thread: threading.Thread | None = None
_failure: str | None = None


def mode() -> str:
    value = os.environ.get(NATIVE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{NATIVE_ENV}={value!r}: choose one of {', '.join(MODES)}")
    return value


def failure() -> str | None:
    """Why the build failed in this process (None: it did not, or was not tried)."""
    return _failure


def _cpu_tag() -> str:
    # -march=native: a build is only valid on CPUs with the same instruction sets (a cache
    # directory shared between machines must not hand one CPU's build to another).
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    text = SOURCE.read_bytes() + platform.machine().encode() + flags.encode()
    return hashlib.sha256(text).hexdigest()[:12]


def cache_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    return Path(root) / "rapidfire_ray"


# Run in a child process: cpp_extension.load's own build directory lock stays behind when a
# process dies mid-build (Ray kills workers) and then blocks every later build on the machine.
# Each child builds in a fresh directory and moves the library into place in one rename (a
# killed one leaves only its scratch directory); our own lock file, which names its process,
# keeps concurrent processes from building it twice.
_BUILD_SCRIPT = """
import os, shutil, sys, tempfile
from torch.utils import cpp_extension
name, source, final = sys.argv[1:4]
scratch = tempfile.mkdtemp(prefix=name + "-", dir=os.path.dirname(final))
cpp_extension.load(name=name, sources=[source], extra_cflags=["-O3", "-march=native"], build_directory=scratch,
                   verbose=False)
os.replace(os.path.join(scratch, name + ".so"), final)
shutil.rmtree(scratch, ignore_errors=True)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take_lock(lock: Path, final: Path) -> bool:
    """True: this process builds (it holds `lock`); False: another process built it meanwhile.
    One builder per machine at a time; a lock left by a dead process (or older than the build
    timeout) is taken over."""
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if final.exists():
                return False
            try:
                pid = int(lock.read_text() or 0)
                stale = not _alive(pid) or time.time() - lock.stat().st_mtime > _BUILD_TIMEOUT_S
            except (OSError, ValueError):
                stale = False  # being written or just removed: look again
            if stale:
                lock.unlink(missing_ok=True)
            else:
                time.sleep(0.5)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True


def _build():
    name = f"rapidfire_codecs_{_cpu_tag()}"
    final = cache_dir() / f"{name}.so"
    if not final.exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = final.with_suffix(".lock")
        if _take_lock(lock, final):
            try:
                if not final.exists():
                    done = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, name, str(SOURCE), str(final)],
                                          capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
                    if done.returncode != 0:
                        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
                        raise RuntimeError(lines[-1] if lines else f"the build exited with {done.returncode}")
            finally:
                lock.unlink(missing_ok=True)
    spec = importlib.util.spec_from_file_location(name, final)
    built = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(built)
    return built


def _build_in_background() -> None:
    global _module, _failure
    try:
        built = _build()
    except Exception as e:  # no compiler, no ninja, ...: the compiled kernels go on serving
        _failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(f"rapidfire_ray codecs: building the native 1-bit CPU kernels failed ({_failure}); "
                      f"using the compiled ones (slower, same results; {NATIVE_ENV}=off skips the build)",
                      RuntimeWarning, stacklevel=2)
        return
    with _lock:
        _module = built


def module():
    """The built extension, or None while it is not (yet) available (see the module docstring)."""
    global _module, _thread
    chosen = mode()
    if chosen == "off":
        return None
    if _module is not None:
        return _module
    if chosen == "always":
        with _lock:
            if _module is None:
                _module = _build()
        return _module
    with _lock:
        if _thread is None and _failure is None:
            _thread = threading.Thread(target=_build_in_background, name="rapidfire-codec-build", daemon=True)
            _thread.start()
    return None


def wait(timeout: float | None = None):
    """Block until a background build has finished (the built module, or None)."""
    thread = _thread
    if thread is not None:
        thread.join(timeout)
    return _module


__all__ = ["MODES", "NATIVE_ENV", "failure", "mode", "module", "wait"]
