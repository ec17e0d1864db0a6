"""Fixtures for tests/exchange: the multi-process gloo runs, each started once per session."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # spawned children import _comm_workers

import _comm_workers


@pytest.fixture(scope="session")
def group2(tmp_path_factory):
    """allreduce + DDP-hook scenarios on 2 gloo ranks (~6 s): one result dict per rank."""
    return _comm_workers.launch(["allreduce", "ddp"], 2, str(tmp_path_factory.mktemp("comm2")))


@pytest.fixture(scope="session")
def group4(tmp_path_factory):
    """allreduce scenarios (and a 2-rank subgroup of global ranks 1, 3) on 4 gloo ranks (~7 s)."""
    return _comm_workers.launch(["allreduce"], 4, str(tmp_path_factory.mktemp("comm4")))
