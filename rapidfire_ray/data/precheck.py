"""Checks of the data files that need no Ray, run by the driver before Ray starts: a file that is
empty, cannot be read, or whose columns cannot fit `data.format` fails in one line (file,
expected columns, found columns, the fix) in a second, not after the cluster and Ray Data have
started. Row-level problems stay with the Ray Data read (data.on_bad_row)."""
from __future__ import annotations

import json
import os

from ..errors import RapidfireError
from .formats import check_format
from .sources import JSONL_SUFFIXES, list_data_files

# The columns (JSON Lines fields) a row of each format must have.
REQUIRED = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
    "oasst": ("message_id", "parent_id", "role", "text"),
    "preference": ("chosen", "rejected"),
    "prompt": ("prompt",),
}
SAMPLE_LINES = 20  # JSON Lines rows looked at per file


def _show(columns) -> str:
    return "[" + ", ".join(columns) + "]" if columns else "none"


def columns_message(name: str, fmt: str, found: list[str], key: str) -> str:
    """'<file>: <key> data.format '<fmt>' expects columns [..], found [..]; <the fix>'."""
    missing = [c for c in REQUIRED[fmt] if c not in found]
    # another training format whose columns are there (an RL run reads `prompt` rows only)
    fits = [] if fmt == "prompt" else [f for f, cols in REQUIRED.items()
                                       if f not in (fmt, "prompt") and all(c in found for c in cols)]
    fix = (f"set data.format to '{fits[0]}' (its columns are there)" if fits else
           f"rename the columns to {_show(REQUIRED[fmt])} or choose the data.format of this file")
    return (f"{key} file {name}: data.format '{fmt}' expects columns {_show(REQUIRED[fmt])}, found {_show(found)} "
            f"(missing {_show(missing)}); {fix}")


def _parquet_columns(path: str, name: str, key: str) -> list[str]:
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except OSError as e:
        raise RapidfireError(f"{key} file {name}: cannot be read ({e.strerror or e}); check the file's permissions "
                             "or copy it again") from None
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a broken file
        msg = " ".join(str(e).split())[:200] or type(e).__name__
        raise RapidfireError(f"{key} file {name}: not a readable Parquet file ({msg}); write it again or remove "
                             "it") from None
    if meta.num_rows == 0:
        raise RapidfireError(f"{key} file {name}: the Parquet file has no rows; remove it or write the data into it")
    return list(schema.names)


def _jsonl_columns(path: str, name: str, key: str) -> list[str] | None:
    """Fields of the first rows' JSON objects (None: no row is a JSON object; the row-level
    check reports those)."""
    rows: list = []
    try:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    rows.append(raw)
                    if len(rows) >= SAMPLE_LINES:
                        break
    except OSError as e:
        raise RapidfireError(f"{key} file {name}: cannot be read ({e.strerror or e}); check the file's permissions "
                             "or copy it again") from None
    if not rows:
        raise RapidfireError(f"{key} file {name}: the file has no rows (only blank lines); remove it or write "
                             "one JSON object per line into it")
    found: list[str] = []
    objects = 0
    for raw in rows:
        try:
            obj = json.loads(raw.decode("utf-8-sig"))
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            objects += 1
            found += [k for k in obj if k not in found]
    return found if objects else None


def check_data_files(path: str, fmt: str, key: str = "data.path") -> list[str]:
    """The files at `path`, each checked: not empty, readable, and (Parquet: its schema; JSON
    Lines: the fields of its first rows) with the columns `fmt` needs. Raises RapidfireError."""
    check_format(fmt)
    files = list_data_files(path)
    for file in files:
        name = os.path.relpath(file) if not os.path.relpath(file).startswith("..") else file
        try:
            size = os.path.getsize(file)
        except OSError as e:
            raise RapidfireError(f"{key} file {name}: cannot be read ({e.strerror or e})") from None
        if size == 0:
            raise RapidfireError(f"{key} file {name}: the file is empty (0 bytes); remove it or write the data "
                                 "into it")
        found = (_jsonl_columns(file, name, key) if file.lower().endswith(JSONL_SUFFIXES)
                 else _parquet_columns(file, name, key))
        if found is not None and any(c not in found for c in REQUIRED[fmt]):
            raise RapidfireError(columns_message(name, fmt, found, key))
    return files
