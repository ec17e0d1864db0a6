"""Data files: find them (``list_data_files``) and parse one into records (``parse_file``).

``parse_file`` is a pure function of (path, bytes, format) so it can run in a Ray Data
``flat_map`` over ``read_binary_files``; the records it returns are described in
``rapidfire_ray.data.formats``.
"""

from __future__ import annotations

import json
import os

from rapidfire_ray.data.formats import assemble_oasst, check_format, make_record, normalise
from rapidfire_ray.errors import RapidfireError

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")
JSONL_SUFFIXES = (".jsonl", ".json")

# Parquet columns each format reads (others are skipped, which saves memory on wide files).
_PARQUET_COLUMNS = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
    "oasst": ("message_id", "parent_id", "role", "text", "lang", "deleted", "review_result"),
    "preference": ("prompt", "chosen", "rejected"),
    "prompt": (),  # every column: the ones besides `prompt` (e.g. `answer`) feed the reward functions
}
_PARQUET_BATCH_ROWS = 4096


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _is_hidden(name: str) -> bool:
    # Like pyarrow/Ray datasets: '.x' (hidden) and '_x' (_SUCCESS, _metadata, _temporary/).
    return name.startswith((".", "_"))


def list_data_files(path: str) -> list[str]:
    """Absolute paths of the data files at ``path`` (a file, or a folder searched recursively
    for .jsonl/.json/.parquet files, skipping names that start with '.' or '_'), sorted."""
    supported = ", ".join(SUPPORTED_SUFFIXES)
    if not isinstance(path, str) or not path.strip():
        raise RapidfireError(
            "data.path is empty; point data.path at a .jsonl/.parquet file or a folder of them"
        )
    abs_path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(abs_path):
        raise RapidfireError(
            f"data.path {path!r} does not exist (resolved to {abs_path}); "
            f"point data.path at a .jsonl/.parquet file or a folder of them"
        )
    if os.path.isdir(abs_path):
        found = []
        for root, dirs, files in os.walk(abs_path):
            dirs[:] = [d for d in dirs if not _is_hidden(d)]
            for name in files:
                if not _is_hidden(name) and _suffix(name) in SUPPORTED_SUFFIXES:
                    full = os.path.join(root, name)
                    if os.path.isfile(full):
                        found.append(full)
        if not found:
            raise RapidfireError(
                f"data.path {path!r} is a folder with no data files (searched {abs_path} "
                f"recursively for {supported}; names starting with '.' or '_' are skipped); "
                f"add data files or point data.path at one"
            )
        return sorted(found)
    if not os.path.isfile(abs_path):
        raise RapidfireError(
            f"data.path {path!r} is not a regular file or folder (resolved to {abs_path}); "
            f"point data.path at a .jsonl/.parquet file or a folder of them"
        )
    suffix = _suffix(abs_path)
    if suffix not in SUPPORTED_SUFFIXES:
        shown = repr(suffix) if suffix else "no suffix"
        raise RapidfireError(
            f"data.path {path!r} has {shown}; supported suffixes are {supported} "
            f"(.json means JSON Lines); convert the file or rename it"
        )
    return [abs_path]


def _jsonl_rows(name: str, content: bytes):
    """Yield (row, source, obj, error) for each non-blank line; row = 1-based line number."""
    lines = content.split(b"\n")
    if lines and lines[0].startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
        lines[0] = lines[0][3:]
    for idx, raw in enumerate(lines):
        row = idx + 1
        source = f"{name}:{row}"
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield row, source, None, f"invalid UTF-8 (byte {exc.start + 1} of the line)"
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield row, source, None, f"invalid JSON: {exc.msg} (column {exc.colno})"
            continue
        except RecursionError:
            yield row, source, None, "invalid JSON: nested too deeply"
            continue
        yield row, source, obj, ""


def _whole_file_json(content: bytes) -> str:
    """'array'/'object' if the file is one JSON document spread over several lines (a
    pretty-printed ``[{...}, ...]`` or ``{...}``) rather than JSON Lines, else ''."""
    for raw in content.split(b"\n"):
        first = raw.strip().lstrip(b"\xef\xbb\xbf").strip()
        if not first:
            continue
        if not first.startswith((b"[", b"{")):
            return ""
        try:
            json.loads(first)
            return ""  # the first line is a whole JSON value: JSON Lines
        except (ValueError, RecursionError):
            pass
        try:
            doc = json.loads(content.decode("utf-8-sig"))
        except (ValueError, RecursionError):
            return ""  # not one document either: report it line by line
        return "array" if isinstance(doc, list) else "object" if isinstance(doc, dict) else ""
    return ""


def _parquet_rows(name: str, content: bytes, fmt: str):
    """Yield (row, source, obj, error) per Parquet row (1-based); a file pyarrow cannot read
    yields one (0, name, None, error) item instead (after any rows read before the failure)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        pf = pq.ParquetFile(pa.BufferReader(content))
        names = set(pf.schema_arrow.names)
        columns = [c for c in _PARQUET_COLUMNS[fmt] if c in names] or None
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns):
            for obj in batch.to_pylist():
                row += 1
                yield row, f"{name}:{row}", obj, ""
    except Exception as exc:  # noqa: BLE001 - any pyarrow failure means "unreadable file"
        msg = " ".join(str(exc).split())[:200] or type(exc).__name__
        where = f" after row {row}" if row else ""
        yield 0, name, None, f"not a readable Parquet file{where}: {msg}"


def parse_file(path: str, content: bytes, fmt: str) -> list[dict]:
    """Every row of one data file -> normalised records (good and bad), in file order.

    ``.jsonl``/``.json`` are JSON Lines: one object per line, 1-based line numbers, blank lines
    skipped. ``.parquet`` rows are numbered from 1. An error about the whole file (unreadable
    Parquet, a JSON array instead of JSON Lines) is one bad record whose source is the bare
    file name. An unknown ``fmt`` or suffix raises RapidfireError.
    """
    check_format(fmt)
    name = os.path.basename(path)
    suffix = _suffix(path)
    if suffix in JSONL_SUFFIXES:
        kind = _whole_file_json(content)
        if kind:
            return [
                make_record(
                    name,
                    f"file is one JSON {kind} spread over several lines, not JSON Lines; "
                    f"write one JSON object per line",
                )
            ]
        items = _jsonl_rows(name, content)
    elif suffix == ".parquet":
        items = _parquet_rows(name, content, fmt)
    else:
        raise RapidfireError(
            f"data file {path!r} has unsupported suffix {suffix!r}; "
            f"supported suffixes are {', '.join(SUPPORTED_SUFFIXES)}"
        )

    if fmt != "oasst":
        records = []
        for _row, source, obj, error in items:
            if error:
                records.append(make_record(source, error))
            else:
                fields = normalise(obj, fmt)
                records.append({"source": source, **fields})
        return records

    # oasst: rows that failed to decode are reported in place; the rest form trees.
    failed: list[tuple[int, dict]] = []
    good: list[tuple[str, dict]] = []
    good_rows: list[int] = []
    for row, source, obj, error in items:
        if error:
            failed.append((row, make_record(source, error)))
        else:
            good.append((source, obj))
            good_rows.append(row)
    row_of_source = dict(zip((s for s, _ in good), good_rows))
    assembled = [(row_of_source[rec["source"]], rec) for rec in assemble_oasst(good)]
    # Sorting by row is stable and a whole-file error (row 0 with rows before it) is rare;
    # put it last in that case, where it happened.
    merged = sorted(failed + assembled, key=lambda item: (item[0] == 0, item[0]))
    return [rec for _row, rec in merged]
