"""A ZeRO-3 checkpoint resumed under another precision: one line naming train.precision."""
from __future__ import annotations

import pytest

from rapidfire_ray.errors import RapidfireError
from rapidfire_ray.worker.loop import check_zero_precision


def _checkpoint(tmp_path, prefix: str):
    step = tmp_path / "checkpoint-00000004" / "global_step4"
    step.mkdir(parents=True)
    for rank in (0, 1):
        (step / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"x")
        (step / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"x")
    return str(tmp_path / "checkpoint-00000004")


def test_a_bf16_checkpoint_resumed_in_fp32_is_refused_with_the_key(tmp_path):
    ckpt = _checkpoint(tmp_path, "bf16_")
    check_zero_precision(ckpt, bf16=True)
    with pytest.raises(RapidfireError, match=r"^train.precision: checkpoint checkpoint-00000004 holds ZeRO-3 .*"
                                             r"saved under bf16 .*this run computes fp32 or fp16"):
        check_zero_precision(ckpt, bf16=False)


def test_an_fp32_checkpoint_resumed_in_bf16_is_refused_and_other_checkpoints_pass(tmp_path):
    ckpt = _checkpoint(tmp_path, "")
    check_zero_precision(ckpt, bf16=False)
    with pytest.raises(RapidfireError, match="saved under fp32 or fp16 .*this run computes bf16"):
        check_zero_precision(ckpt, bf16=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes(b"x")
    check_zero_precision(str(plain), bf16=True)  # not a ZeRO checkpoint: nothing to check
