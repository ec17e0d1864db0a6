"""Paths the tests share (import these, not conftest: each test folder may have its own conftest)."""
from __future__ import annotations

import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "jobs", "data", "sft_sample.jsonl")
TINY_PROFILE = os.path.join(REPO, "jobs", "configs", "tiny.yaml")


def load_script(path: str, name: str):
    """Import a script that is not in a package (bench/*.py, cluster/local/netns.py) as `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up by name
    spec.loader.exec_module(mod)
    return mod
