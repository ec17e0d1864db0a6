"""Secrets (hub tokens, tracker keys) come in through environment variables and never go out:
what the project prints or writes has their values replaced by `***`.

A secret is the value of an environment variable whose name says so (HF_TOKEN,
HUGGING_FACE_HUB_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, ...: names with TOKEN, KEY,
SECRET, PASSWORD or CREDENTIAL in them) and which is at least 8 characters long; paths to token
files (RAY_AUTH_TOKEN_PATH) are not secrets.
"""
from __future__ import annotations

import io
import os
import re
import sys
from typing import Any, Mapping

MASK = "***"
_SECRET_NAME = re.compile(r"(^|_)(TOKEN|KEY|APIKEY|SECRET|PASSWORD|PASSWD|CREDENTIALS?)($|_)", re.IGNORECASE)
_NOT_SECRET = re.compile(r"_(PATH|FILE|DIR|ID|NAME|TYPE|MODE)$", re.IGNORECASE)


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values to hide, longest first (so one that contains another is masked whole)."""
    environ = os.environ if environ is None else environ
    values = {v for k, v in environ.items()
              if _SECRET_NAME.search(k) and not _NOT_SECRET.search(k) and len(v.strip()) >= 8}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, values: list[str] | None = None) -> str:
    for value in secret_values() if values is None else values:
        if value in text:
            text = text.replace(value, MASK)
    return text


def redact(obj: Any, values: list[str] | None = None) -> Any:
    """A copy of `obj` (dicts, lists, strings, numbers) with every secret value masked, in keys too."""
    values = secret_values() if values is None else values
    if not values:
        return obj
    if isinstance(obj, str):
        return redact_text(obj, values)
    if isinstance(obj, Mapping):
        return {redact(k, values): redact(v, values) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, values) for v in obj)
    return obj


class RedactingStream(io.TextIOBase):
    """Wraps stdout/stderr: complete lines are written with secret values masked (a value split
    across two writes is masked too, since text is held back until its line ends)."""

    def __init__(self, stream, values: list[str]):
        self._stream, self._values, self._pending = stream, values, ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            done, _, self._pending = self._pending.rpartition("\n")
            self._stream.write(redact_text(done + "\n", self._values))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(redact_text(self._pending, self._values))
            self._pending = ""
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):
        return getattr(self._stream, "encoding", "utf-8")


def redact_std_streams() -> None:
    """Mask secret values in everything this process prints (the driver's lines, Ray's forwarded
    worker logs, tracebacks). A no-op without secrets in the environment."""
    values = secret_values()
    if values and not isinstance(sys.stdout, RedactingStream):
        sys.stdout = RedactingStream(sys.stdout, values)
        sys.stderr = RedactingStream(sys.stderr, values)
