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


def test_injected_out_of_memory_caps_a_forward_pass_by_rows():
    import torch

    from rapidfire_ray.faults import OOM_ROWS, cap_forward_rows, oom_rows, slot_env
    from rapidfire_ray.models import load_model

    assert oom_rows({}) is None and slot_env({"HOME": "/root"}) == {}
    assert slot_env({OOM_ROWS: " 4 "}) == {OOM_ROWS: "4"}
    for bad in ("0", "x", "-2"):
        with pytest.raises(RapidfireError, match=f"{OOM_ROWS}=.*rows >= 1") as e:
            oom_rows({OOM_ROWS: bad})
        assert "\n" not in str(e.value)
    model = load_model("tiny-random")
    cap_forward_rows(model, {OOM_ROWS: "4"})
    ids = torch.ones(4, 8, dtype=torch.long)
    assert model(input_ids=ids).logits.shape[0] == 4  # up to the cap: untouched
    with pytest.raises(torch.OutOfMemoryError, match="5 rows, more than the 4"):
        model(input_ids=torch.ones(5, 8, dtype=torch.long))
    untouched = load_model("tiny-random")
    cap_forward_rows(untouched, {})
    assert untouched(input_ids=torch.ones(9, 8, dtype=torch.long)).logits.shape[0] == 9
