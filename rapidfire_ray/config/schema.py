"""The one typed schema for `train_config.yaml` (OmegaConf structured dataclasses).

Every tunable lives here with its default, its unit and a one-line doc. Values whose
feature arrives with a later part of the project are listed in `PLANNED` and refused by
`load.validate` with a one-line error, so a value that is accepted always does what it says.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class RunSection:
    name: str = "rapidfire-run"  # run name: folder under output_dir, Ray Train run name
    output_dir: str = "runs"  # where checkpoints, the final model and run_summary.json go
    seed: int = 42  # seeds torch, data order and model init


@dataclass
class ModelSection:
    # a built-in name (smollm2-135m, tiny-random), a local HF model directory or a hub id
    name: str = "smollm2-135m"


@dataclass
class DynamicBatchSection:
    strategy: str = "fixed"  # fixed | token_budget | memory_aware
    min: Optional[int] = None  # smallest batch (rows) a dynamic strategy may pick
    max: Optional[int] = None  # largest batch (rows) a dynamic strategy may pick


@dataclass
class DataSection:
    path: str = "jobs/data/sft_sample.jsonl"  # a .jsonl/.parquet file or a folder of them
    format: str = "prompt_completion"  # text | prompt_completion | messages | oasst
    max_length: int = 512  # tokens; longer rows are truncated
    on_bad_row: str = "skip"  # skip (count and report) | fail (stop naming the row)
    prefetch_depth: int = 3  # batches prepared ahead of the step that needs them
    dynamic_batch: DynamicBatchSection = field(default_factory=DynamicBatchSection)


@dataclass
class TrainSection:
    stage: str = "sft"  # sft | reward | rl | pipeline
    max_steps: int = -1  # optimizer steps; -1 runs `epochs` epochs (as in transformers)
    epochs: float = 1.0  # passes over the data when max_steps is -1
    per_device_batch_size: int = 4  # rows per worker per micro-batch
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    lr_scheduler: str = "linear"  # constant | linear | cosine
    warmup_steps: int = 0  # steps of linear learning-rate warm-up
    log_every_steps: int = 1  # progress and metric reports, in optimizer steps


@dataclass
class CompressionSection:
    grad: str = "none"  # none | fp16 | 1bit | 2bit | auto: gradient codec on the wire
    act: str = "none"  # none | int8: saved-activation compression


@dataclass
class OptimizerParams:
    lr: float = 2.0e-5  # peak learning rate
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1.0e-8
    compression: CompressionSection = field(default_factory=CompressionSection)


@dataclass
class OptimizerSection:
    type: str = "adamw"  # adamw | rapidfire_adamw
    params: OptimizerParams = field(default_factory=OptimizerParams)


@dataclass
class ScalingSection:
    num_workers: int = 2  # Ray Train workers (one process each)
    use_gpu: bool = False  # one GPU per worker when true
    cpus_per_worker: int = 1  # CPUs reserved per worker; also its torch thread count


@dataclass
class CommunicationSection:
    mode: str = "allreduce"  # allreduce | allreduce_compressed | parameter_server


@dataclass
class MemorySection:
    optim_level: str = "level0"  # level0 | level1 | level2 | level3


@dataclass
class CheckpointSection:
    every_steps: int = 50  # save a Ray Train checkpoint every N optimizer steps (0: only at the end)
    keep: int = 2  # newest checkpoints kept on storage


@dataclass
class RapidfireConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    communication: CommunicationSection = field(default_factory=CommunicationSection)
    memory: MemorySection = field(default_factory=MemorySection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)


# key -> (values that work now, values planned for a later part of the project)
CHOICES = {
    "data.format": (("text", "prompt_completion", "messages", "oasst"), ()),
    "data.on_bad_row": (("skip", "fail"), ()),
    "data.dynamic_batch.strategy": (("fixed",), ("token_budget", "memory_aware")),
    "train.stage": (("sft",), ("reward", "rl", "pipeline")),
    "train.lr_scheduler": (("constant", "linear", "cosine"), ()),
    "optimizer.type": (("adamw",), ("rapidfire_adamw",)),
    "optimizer.params.compression.grad": (("none",), ("fp16", "1bit", "2bit", "auto")),
    "optimizer.params.compression.act": (("none",), ("int8",)),
    "communication.mode": (("allreduce",), ("allreduce_compressed", "parameter_server")),
    "memory.optim_level": (("level0",), ("level1", "level2", "level3")),
}

# key -> (lowest allowed, highest allowed or None), inclusive
RANGES = {
    "run.seed": (0, 2**32 - 1),
    "data.max_length": (8, None),
    "data.prefetch_depth": (0, 64),
    "data.dynamic_batch.min": (1, None),
    "data.dynamic_batch.max": (1, None),
    "train.epochs": (0.001, None),
    "train.per_device_batch_size": (1, None),
    "train.gradient_accumulation_steps": (1, None),
    "train.grad_clip": (0.0, None),
    "train.warmup_steps": (0, None),
    "train.log_every_steps": (1, None),
    "optimizer.params.lr": (0.0, 1.0),
    "optimizer.params.weight_decay": (0.0, 1.0),
    "optimizer.params.eps": (0.0, 1.0),
    "scaling.num_workers": (1, None),
    "scaling.cpus_per_worker": (1, None),
    "checkpoint.every_steps": (0, None),
    "checkpoint.keep": (1, None),
}

# Which later part of the project brings each planned feature (for the refusal message).
PLANNED_IN = {
    "data.dynamic_batch.strategy": "the data-layer release (dynamic batching)",
    "train.stage": "the reward/RL stages release",
    "optimizer.type": "the compressed-communication release",
    "optimizer.params.compression.grad": "the compressed-communication release",
    "optimizer.params.compression.act": "the memory release",
    "communication.mode": "the compressed-communication / parameter-server releases",
    "memory.optim_level": "the memory release",
}
