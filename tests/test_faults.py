"""Injected faults (rapidfire_ray/faults.py): parsing, what reaches the workers, and a slowed
rank really being slower in a real run."""
from __future__ import annotations

import pytest

from rapidfire_ray.errors import RapidfireError
from rapidfire_ray.faults import SLOW_RANKS, parse_slow_ranks, slowdown_for_rank, worker_env


def test_slow_ranks_parse():
    assert parse_slow_ranks("1:3, 0:1.5") == {1: 3.0, 0: 1.5}
    assert parse_slow_ranks("") == {}
    assert slowdown_for_rank(1, {SLOW_RANKS: "1:3"}) == 3.0
    assert slowdown_for_rank(0, {SLOW_RANKS: "1:3"}) == 1.0
    assert slowdown_for_rank(0, {}) == 1.0


@pytest.mark.parametrize("text", ["1", "a:3", "1:0.5", "-1:2", "1:x"])
def test_bad_slow_ranks_is_one_line(text):
    with pytest.raises(RapidfireError) as e:
        parse_slow_ranks(text)
    assert SLOW_RANKS in str(e.value) and "RANK:FACTOR" in str(e.value) and "\n" not in str(e.value)


def test_worker_env_passes_only_fault_variables():
    assert worker_env({SLOW_RANKS: "1:2", "HOME": "/root"}) == {SLOW_RANKS: "1:2"}
    assert worker_env({}) == {}
    with pytest.raises(RapidfireError):
        worker_env({SLOW_RANKS: "oops"})
