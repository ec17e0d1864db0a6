"""The run board: typed facts, worker reports, and a barrier that waits without polling."""
from __future__ import annotations

import threading

import pytest

from rapidfire_ray.telemetry.records import StepRecord, WorkerReport


def test_step_record_is_one_flat_steps_jsonl_line():
    r = StepRecord(rank=1, step=3, phases={"step": 0.5}, samples=8, tokens=100, padded_tokens=120,
                   peak_memory_bytes=10, world=2, attempt=0, counters={"bytes_sent": 4, "skipped_steps": 0})
    d = r.to_dict()
    assert d["rank"] == 1 and d["bytes_sent"] == 4 and d["world"] == 2 and "counters" not in d
    assert "knobs" not in d and "rl" not in d  # absent parts stay out of the line
    assert StepRecord(**{**r.__dict__, "knobs": {"data.prefetch_depth": 2}}).to_dict()["knobs"] == {
        "data.prefetch_depth": 2}
    with pytest.raises(ValueError, match="shadow"):
        StepRecord(rank=0, step=1, phases={}, samples=0, tokens=0, padded_tokens=0, peak_memory_bytes=0,
                   counters={"step": 2}).to_dict()


def test_board_facts_and_worker_reports(ray_cluster):
    import ray

    from rapidfire_ray.telemetry.board import RunBoard

    board = RunBoard.remote()
    try:
        assert ray.get(board.shard_plan.remote()) is None
        ray.get(board.publish_shard_plan.remote({"num_rows": 4}))
        assert ray.get(board.shard_plan.remote()) == {"num_rows": 4}
        assert [ray.get(board.start_attempt.remote()) for _ in range(3)] == [0, 1, 2]
        ray.get(board.report_elastic_start.remote(1, {"world": 2}))
        assert ray.get(board.elastic_starts.remote()) == [None, {"world": 2}, None]
        ray.get(board.report_worker_end.remote(WorkerReport(rank=1, skipped_steps=2)))
        ray.get(board.report_worker_end.remote(WorkerReport(rank=0, held_bytes={"total": 5})))
        ray.get(board.report_worker_end.remote(WorkerReport(rank=1, skipped_steps=3)))  # a restarted rank
        reports = ray.get(board.worker_reports.remote())
        assert [(w.rank, w.skipped_steps) for w in reports] == [(0, 0), (1, 3)]
    finally:
        ray.kill(board)


def test_gather_min_waits_for_every_rank_and_starts_a_new_round_per_worker_group(ray_cluster):
    import ray

    from rapidfire_ray.telemetry.board import RunBoard

    board = RunBoard.remote()
    try:
        first = board.gather_min.remote("free_bytes", 0, 3, 30)
        second = board.gather_min.remote("free_bytes", 1, 3, 10)
        ready, _ = ray.wait([first, second], timeout=1.0)
        assert not ready  # rank 2 has not come yet
        results = {}
        t = threading.Thread(target=lambda: results.update(r2=ray.get(board.gather_min.remote("free_bytes", 2, 3, 20))))
        t.start()
        assert ray.get([first, second], timeout=30) == [10, 10]
        t.join(30)
        assert results["r2"] == 10
        # A restarted worker group: a new round with new values.
        again = [board.gather_min.remote("free_bytes", r, 2, v) for r, v in ((0, 7), (1, 9))]
        assert ray.get(again, timeout=30) == [7, 7]
    finally:
        ray.kill(board)
