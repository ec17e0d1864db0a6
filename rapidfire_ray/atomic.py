"""Write-then-rename helpers: a crash never leaves a half-written file or folder in place, and
an earlier complete version stays until the new one is whole."""
from __future__ import annotations

import json
import os
import shutil

from .secrets import redact


def atomic_write_json(path: str, data: dict) -> str:
    data = redact(data)  # no secret value from the environment is ever written (secrets.py)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def atomic_write_jsonl(path: str, rows: list[dict]) -> str:
    rows = redact(rows)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def fsync_tree(directory: str) -> None:
    """Flush a finished folder's files to disk before it is renamed into place."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def publish_dir(tmp: str, final: str) -> str:
    """Move the complete folder `tmp` to `final`, replacing an existing `final` only once `tmp`
    is in place (the old one is put back if the swap fails)."""
    fsync_tree(tmp)
    old = f"{final}.tmp-{os.getpid()}-old"
    if os.path.lexists(old):
        shutil.rmtree(old)
    if os.path.lexists(final):
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if os.path.lexists(old) and not os.path.lexists(final):
            os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final
