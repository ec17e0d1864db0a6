"""Scoring a completion of the sample task (`jobs/data/`): every row carries its canonical
`answer`; a completion is right when the answer it states equals it.

A completion states its answer either as the whole text (prompts that ask for the answer only)
or after the last "The answer is " (prompts that ask for an explanation), as the SFT rows do.
"""
from __future__ import annotations

import re

_MARKER = re.compile(r"the answer is\s*", re.IGNORECASE)


def _normalise(text: str) -> str:
    text = text.strip().rstrip(".!").strip().strip("\"'`").strip().rstrip(".!").strip()
    return re.sub(r"\s+", " ", text)


def extract_answer(completion: str) -> str:
    """The answer a completion states: the text after the last "The answer is", else its first
    line; trimmed of quotes, a final full stop and repeated spaces ("" when there is none)."""
    found = list(_MARKER.finditer(completion))
    if found:
        tail = completion[found[-1].end():]
    else:
        tail = completion.strip().split("\n", 1)[0] if completion.strip() else ""
    return _normalise(tail)


def score_completion(completion: str, answer: str) -> float:
    """1.0 when the stated answer equals `answer` (numbers compared as numbers, text exactly,
    case kept: the uppercase/lowercase tasks depend on it), else 0.0."""
    stated, want = extract_answer(completion), _normalise(str(answer))
    if stated == want:
        return 1.0
    try:
        return 1.0 if float(stated.replace(",", "")) == float(want.replace(",", "")) else 0.0
    except ValueError:
        return 0.0
