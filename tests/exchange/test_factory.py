"""`build_exchange` chooses the exchange from `communication.mode` and `optimizer.type`."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rapidfire_ray.config import load_config
from rapidfire_ray.exchange import build_exchange
from rapidfire_ray.exchange.compressed import CompressedExchange
from rapidfire_ray.exchange.ddp import DdpExchange
from rapidfire_ray.exchange.onebit_adam import OneBitAdamExchange
from rapidfire_ray.exchange.parameter_server import ParameterServerExchange
from paths import TINY_PROFILE


def config(*overrides: str) -> dict:
    return OmegaConf.to_container(load_config(TINY_PROFILE, list(overrides)))


@pytest.mark.parametrize("overrides, cls, process_group", [
    ((), DdpExchange, True),
    (("communication.mode=allreduce_compressed", "optimizer.params.compression.grad=1bit"), CompressedExchange, True),
    (("optimizer.type=rapidfire_adamw", "optimizer.params.compression.grad=1bit"), OneBitAdamExchange, True),
    (("communication.mode=parameter_server",), ParameterServerExchange, False),
    (("communication.mode=parameter_server", "optimizer.type=rapidfire_adamw",
      "optimizer.params.compression.grad=1bit"), ParameterServerExchange, False),
])
def test_the_mode_chooses_the_exchange(overrides, cls, process_group):
    cfg = config(*overrides)
    exchange = build_exchange(cfg["communication"], cfg["optimizer"], rank=1, total_steps=50, shards=[],
                              num_workers=cfg["scaling"]["num_workers"])
    assert type(exchange) is cls and exchange.rank == 1 and exchange.has_process_group is process_group
    assert exchange.on_nonfinite == "skip" and exchange.skipped_steps == 0


def test_rapidfire_adamw_warms_up_for_a_fifth_of_the_run_unless_told():
    cfg = config("optimizer.type=rapidfire_adamw", "optimizer.params.compression.grad=1bit")
    assert build_exchange(cfg["communication"], cfg["optimizer"], rank=0, total_steps=50).freeze_step == 10
    cfg = config("optimizer.type=rapidfire_adamw", "optimizer.params.compression.grad=1bit",
                 "optimizer.params.freeze_step=3")
    assert build_exchange(cfg["communication"], cfg["optimizer"], rank=0, total_steps=50).freeze_step == 3


def test_parameter_server_lr_per_push_mean_divides_by_the_workers():
    cfg = config("communication.mode=parameter_server", "optimizer.params.compression.grad=1bit")
    exchange = build_exchange(cfg["communication"], cfg["optimizer"], rank=0, total_steps=8, shards=[], num_workers=2)
    assert exchange.lr_divisor == 2 and exchange.codec == "1bit"
    assert exchange.codec_opts == {"chunk_size": cfg["optimizer"]["params"]["compression"]["chunk_size"], "scale": "rms"}
