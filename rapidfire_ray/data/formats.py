"""Row formats: turn one decoded row (a dict) into a *normalised record*.

A record is a plain dict with exactly the keys in ``RECORD_KEYS`` and only ``str`` values
(never ``None``), so every record of every file has the same Arrow schema:

- ``source``: ``"<basename>:<row>"`` (1-based row), or ``"<basename>"`` for an error about the
  whole file (see ``sources.parse_file``);
- ``error``: ``""`` for a good record, else a short reason naming the field;
- ``text`` / ``prompt`` / ``completion`` / ``messages``: the content; unused ones are ``""``.
  ``messages`` is ``json.dumps([{"role": ..., "content": ...}, ...], ensure_ascii=False)``.
- ``chosen`` / ``rejected``: the two sides of a ``preference`` pair (see ``preference.py``).
- ``extra``: a ``prompt`` row's other columns (e.g. ``answer``) as a JSON object (see ``prompts.py``).

Bad rows are not fatal here: they come back as records with ``error`` set, and the caller
counts/reports them or stops at the first one. Everything here is a pure function of its
arguments (it runs inside Ray Data tasks).
"""

from __future__ import annotations

import json
from typing import Any

from rapidfire_ray.errors import RapidfireError

FORMATS = ("text", "prompt_completion", "messages", "oasst", "preference", "prompt")
RECORD_KEYS = ("source", "error", "text", "prompt", "completion", "messages", "chosen", "rejected", "extra")
CHAT_ROLES = ("system", "user", "assistant")
OASST_ROLES = {"prompter": "user", "assistant": "assistant"}
DROPPED_REASON = "deleted/failed review"

_CONTENT_KEYS = RECORD_KEYS[2:]


def check_format(fmt: str) -> None:
    """Raise a RapidfireError unless ``fmt`` is one of ``FORMATS``."""
    if fmt not in FORMATS:
        raise RapidfireError(
            f"data.format {fmt!r} is not supported; set data.format to one of {', '.join(FORMATS)}"
        )


def make_record(source: str, error: str = "", **fields: str) -> dict:
    """A record with every key of RECORD_KEYS; content fields not given are ""."""
    unknown = set(fields) - set(_CONTENT_KEYS)
    if unknown:
        raise ValueError(f"unknown record fields: {sorted(unknown)}")
    rec = {"source": str(source), "error": str(error)}
    for key in _CONTENT_KEYS:
        value = fields.get(key, "")
        rec[key] = "" if error else value
    return rec


def _fields(error: str = "", **fields: str) -> dict:
    """Record fields without ``source`` (what ``normalise`` returns)."""
    rec = make_record("", error, **fields)
    del rec["source"]
    return rec


def type_name(value: Any) -> str:
    """The JSON-ish name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _is_valid_unicode(s: str) -> bool:
    # json.loads accepts "\ud800"; such a string cannot be encoded to UTF-8 (nor stored in Arrow).
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_string(value: Any, name: str, *, allow_empty: bool = False) -> str:
    """'' if ``value`` is an acceptable string for field ``name``, else the reason."""
    if not isinstance(value, str):
        return f"field {name!r} must be a string, got {type_name(value)}"
    if not _is_valid_unicode(value):
        return f"invalid text in {name!r} (lone surrogate, not valid Unicode)"
    if not allow_empty and not value.strip():
        return f"empty text in {name!r}"
    return ""


def _get_string(obj: dict, name: str) -> tuple[str, str]:
    """(value, error) for a required non-empty string field of ``obj``."""
    if name not in obj:
        return "", f"missing field {name!r}"
    err = _check_string(obj[name], name)
    return (obj[name], "") if not err else ("", err)


def _check_messages(value: Any, name: str, *, need_assistant: bool) -> tuple[list, str]:
    """Validate a list of chat messages -> ([{"role", "content"}, ...], error)."""
    if not isinstance(value, list):
        return [], f"field {name!r} must be a list of messages, got {type_name(value)}"
    if not value:
        return [], f"empty list in {name!r}"
    out = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            return [], f"{where} must be an object with 'role' and 'content', got {type_name(msg)}"
        for key in ("role", "content"):
            if key not in msg:
                return [], f"missing field {where + '.' + key!r}"
        role = msg["role"]
        if not isinstance(role, str) or role not in CHAT_ROLES:
            shown = repr(role) if isinstance(role, str) else type_name(role)
            return [], f"{where}.role is {shown}; expected one of {', '.join(CHAT_ROLES)}"
        err = _check_string(msg["content"], f"{where}.content", allow_empty=True)
        if err:
            return [], err
        out.append({"role": role, "content": msg["content"]})
    if need_assistant and not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        return [], f"no assistant message with non-empty content in {name!r}"
    return out, ""


def _dump_messages(messages: list) -> str:
    return json.dumps(messages, ensure_ascii=False)


def _normalise_prompt_completion(obj: dict) -> dict:
    for name in ("prompt", "completion"):
        if name not in obj:
            return _fields(f"missing field {name!r}")
    prompt, completion = obj["prompt"], obj["completion"]
    if isinstance(prompt, list) or isinstance(completion, list):
        # TRL's conversational prompt-completion: both are lists of {role, content} messages.
        for name, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, list):
                other = "completion" if name == "prompt" else "prompt"
                return _fields(
                    f"field {name!r} must be a list of messages like {other!r}, "
                    f"got {type_name(value)}"
                )
        p_msgs, err = _check_messages(prompt, "prompt", need_assistant=False)
        if err:
            return _fields(err)
        c_msgs, err = _check_messages(completion, "completion", need_assistant=True)
        if err:
            return _fields(err)
        return _fields(messages=_dump_messages(p_msgs + c_msgs))
    for name, value in (("prompt", prompt), ("completion", completion)):
        err = _check_string(value, name)
        if err:
            return _fields(err)
    return _fields(prompt=prompt, completion=completion)


def _validate_oasst_row(obj: dict) -> str:
    """'' if ``obj`` is a usable oasst message row, else the reason (structure only)."""
    for name in ("message_id", "parent_id", "role", "text"):
        if name not in obj:
            return f"missing field {name!r}"
    err = _check_string(obj["message_id"], "message_id")
    if err:
        return err
    parent = obj["parent_id"]
    if parent is not None:
        err = _check_string(parent, "parent_id")
        if err:
            return f"{err} (or null for a root message)"
    role = obj["role"]
    if not isinstance(role, str) or role not in OASST_ROLES:
        shown = repr(role) if isinstance(role, str) else type_name(role)
        return f"field 'role' is {shown}; expected 'prompter' or 'assistant'"
    err = _check_string(obj["text"], "text")
    if err:
        return err
    lang = obj.get("lang")
    if lang is not None and not isinstance(lang, str):
        return f"field 'lang' must be a string, got {type_name(lang)}"
    if obj.get("deleted") is True or obj.get("review_result") is False:
        return DROPPED_REASON
    return ""


def normalise(obj: dict, fmt: str) -> dict:
    """One decoded row -> record fields (every key of RECORD_KEYS except ``source``).

    ``error`` is "" for a good row, else the reason (and the content fields are all "").
    For ``oasst`` a single row is only validated (content fields stay ""): conversations need
    the whole file, see ``assemble_oasst``. An unknown ``fmt`` raises RapidfireError.
    """
    check_format(fmt)
    if not isinstance(obj, dict):
        return _fields(f"row is a JSON {type_name(obj)}, expected an object")
    if fmt == "text":
        text, err = _get_string(obj, "text")
        return _fields(err) if err else _fields(text=text)
    if fmt == "prompt_completion":
        return _normalise_prompt_completion(obj)
    if fmt == "messages":
        if "messages" not in obj:
            return _fields("missing field 'messages'")
        msgs, err = _check_messages(obj["messages"], "messages", need_assistant=True)
        return _fields(err) if err else _fields(messages=_dump_messages(msgs))
    if fmt == "preference":
        from .preference import normalise_preference

        fields = normalise_preference(obj)
        return _fields(fields.pop("error"), **fields)
    if fmt == "prompt":
        from .prompts import normalise_prompt

        fields = normalise_prompt(obj)
        return _fields(fields.pop("error"), **fields)
    return _fields(_validate_oasst_row(obj))  # oasst


def assemble_oasst(rows: list[tuple[str, dict]]) -> list[dict]:
    """OpenAssistant (oasst1) message rows of one file -> records, in file order.

    ``rows`` are ``(source, obj)`` pairs. Each bad row gives one bad record with its own source:
    invalid fields, ``deleted: true`` / ``review_result: false`` (reason ``deleted/failed
    review``), a duplicate ``message_id``, a ``parent_id`` not in the file, a parent that is
    itself a bad row, a ``parent_id`` cycle, a root that is not a prompter, or two messages of
    the same role in a row. Good messages are joined into conversations: one record per
    assistant message with no assistant message below it (each root-to-leaf path, cut after
    its last assistant message), as ``messages`` with roles prompter->user,
    assistant->assistant, and the source of that last assistant message. Good messages that end
    no such path (e.g. an unanswered prompt) produce no record and are not errors.
    """
    n = len(rows)
    errors = [""] * n
    by_id: dict[str, int] = {}  # message_id -> index of its (first) row with a usable id
    dropped: dict[str, str] = {}  # message_id -> reason, for bad rows that still had an id

    for i, (_source, obj) in enumerate(rows):
        if not isinstance(obj, dict):
            errors[i] = f"row is a JSON {type_name(obj)}, expected an object"
            continue
        err = _validate_oasst_row(obj)
        mid = obj.get("message_id")
        has_id = isinstance(mid, str) and mid.strip() != "" and _is_valid_unicode(mid)
        if has_id and mid in by_id:
            err = err or f"duplicate message_id {mid!r} (first at {rows[by_id[mid]][0]})"
            errors[i] = err
            continue
        if has_id and not err:
            by_id[mid] = i
        elif has_id:
            dropped.setdefault(mid, err)
        errors[i] = err

    # Resolve each good message against its ancestors (iteratively: no recursion, no hang).
    OK = "ok"
    state: dict[int, str] = {}  # row index -> OK or error
    for start in by_id.values():
        if start in state:
            continue
        path: list[int] = []
        on_path: set[int] = set()
        i = start
        while True:
            if i in state:
                break
            if i in on_path:  # cycle: every message on the loop is bad, those leading in too
                loop_id = rows[i][1]["message_id"]
                cut = path.index(i)
                for j in path[cut:]:
                    state[j] = f"parent_id cycle involving message {loop_id!r}"
                path = path[:cut]
                break
            path.append(i)
            on_path.add(i)
            obj = rows[i][1]
            pid = obj["parent_id"]
            if pid is None:
                if obj["role"] != "prompter":
                    state[i] = f"root message has role {obj['role']!r}; a root must be 'prompter'"
                else:
                    state[i] = OK
                path.pop()
                break
            if pid not in by_id:
                if pid in dropped:
                    state[i] = f"parent {pid!r} is a bad row ({dropped[pid]})"
                else:
                    state[i] = f"parent_id {pid!r} not found in this file"
                path.pop()
                break
            i = by_id[pid]
        # Walk back down the path: each child's verdict follows from its parent's.
        for j in reversed(path):
            obj = rows[j][1]
            parent_idx = by_id[obj["parent_id"]]
            parent_state = state[parent_idx]
            if parent_state != OK:
                pid = obj["parent_id"]
                state[j] = f"parent {pid!r} is a bad row"
            elif rows[parent_idx][1]["role"] == obj["role"]:
                state[j] = (
                    f"role {obj['role']!r} follows a {obj['role']!r} message; roles must alternate"
                )
            else:
                state[j] = OK

    for i, st in state.items():
        if st != OK:
            errors[i] = st

    # Good assistant messages with a good assistant message somewhere below them are not leaves.
    has_assistant_below: set[int] = set()
    for i, st in state.items():
        if st != OK or rows[i][1]["role"] != "assistant":
            continue
        j = by_id.get(rows[i][1]["parent_id"])
        while j is not None and j not in has_assistant_below:
            has_assistant_below.add(j)
            j = by_id.get(rows[j][1]["parent_id"])

    records = []
    for i, (source, obj) in enumerate(rows):
        if errors[i]:
            records.append(make_record(source, errors[i]))
            continue
        if obj["role"] != "assistant" or i in has_assistant_below:
            continue
        chain = []
        j = i
        while j is not None:
            chain.append(rows[j][1])
            j = by_id.get(rows[j][1]["parent_id"])
        messages = [{"role": OASST_ROLES[m["role"]], "content": m["text"]} for m in reversed(chain)]
        records.append(make_record(source, messages=_dump_messages(messages)))
    return records
