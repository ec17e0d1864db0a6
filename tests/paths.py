"""Paths the tests share (import these, not conftest: each test folder may have its own conftest)."""
from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "jobs", "data", "sft_sample.jsonl")
TINY_PROFILE = os.path.join(REPO, "jobs", "configs", "tiny.yaml")
