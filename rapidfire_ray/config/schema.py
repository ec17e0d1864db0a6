"""The one typed schema for `train_config.yaml` (OmegaConf structured dataclasses).

Every tunable lives here with its default, its unit and a one-line doc; `CHOICES` and `RANGES`
say what `load.validate` accepts (anything else is a one-line error), so a value that is accepted
always does what it says.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional

MISSING_FACTORY = MISSING_DEFAULT = MISSING


def opt(default: Any, doc: str):
    """A config key with its default and a one-line doc (shown by `rapidfire config --reference`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class RunSection:
    name: str = opt("rapidfire-run", "run name: folder under output_dir, Ray Train run name")
    output_dir: str = opt("runs", "where checkpoints, the final model and run_summary.json go")
    seed: int = opt(42, "seeds torch, data order and model init")


@dataclass
class ModelSection:
    name: str = opt("smollm2-135m",
                    "a built-in name (smollm2-135m, tiny-random), a local HF model directory or a hub id")


@dataclass
class DynamicBatchSection:
    strategy: str = opt("fixed", "how batches are cut: fixed rows, a token budget, or from free memory")
    min: Optional[int] = opt(None, "memory_aware: smallest batch (rows) it may pick (null: 1; met where max >= 2 x min - 1)")
    max: Optional[int] = opt(None, "largest batch (rows) a dynamic strategy may pick (null: no cap)")
    max_tokens: Optional[int] = opt(None, "token_budget: padded tokens per batch per worker "
                                          "(null: per_device_batch_size x data.max_length)")
    window: int = opt(1024, "dynamic strategies: rows sorted by length together before cutting batches")
    max_padding: float = opt(0.05, "dynamic strategies: padding tokens a batch may hold, as a fraction of its "
                                   "tokens")
    memory_threshold: float = opt(0.8, "share of the worker's free memory (GPU; on CPU its memory limit) a step "
                                       "may use, in (0, 1]: memory_aware batch sizes and memory level1+ "
                                       "checkpointing plans are sized to it")


@dataclass
class DataSection:
    path: str = opt("jobs/data/sft_sample.jsonl", "a .jsonl/.parquet file or a folder of them")
    format: str = opt("prompt_completion", "row layout of the data files (see the README)")
    max_length: int = opt(512, "tokens per row at most (see overlong)")
    overlong: str = opt("truncate", "rows longer than max_length: truncate them, or drop them (counted)")
    on_bad_row: str = opt("skip", "skip: count and report bad rows; fail: stop at the first, naming it")
    prefetch_depth: int = opt(3, "batches prepared ahead of the step that needs them")
    shard_by_node: bool = opt(True, "each worker reads rows from blocks on its own node where possible "
                                    "(always every row once per epoch)")
    dynamic_batch: DynamicBatchSection = field(default_factory=DynamicBatchSection)
    eval_path: Optional[str] = opt(None, "train.stage reward: held-out preference pairs (same format as data.path) "
                                         "scored after training: pairwise accuracy and reward margin in the summary "
                                         "(null: none)")


@dataclass
class TrainSection:
    stage: str = opt("sft", "what to train: SFT, a reward model, RL, or all three in a row")
    max_steps: int = opt(-1, "optimizer steps; -1 runs `epochs` epochs (as in transformers)")
    epochs: float = opt(1.0, "passes over the data when max_steps is -1")
    per_device_batch_size: int = opt(4, "rows per worker per micro-batch")
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step")
    grad_clip: float = opt(1.0, "max global gradient norm; 0 disables clipping")
    lr_scheduler: str = opt("linear", "learning-rate schedule after warm-up")
    warmup_steps: int = opt(0, "steps of linear learning-rate warm-up")
    log_every_steps: int = opt(1, "progress and metric reports, in optimizer steps")
    precision: str = opt("auto", "compute precision (weights and optimizer stay fp32); auto: by parameter count "
                                 "and hardware (< 7B fp16, 7-20B bf16, > 20B fp8 where the GPU has it; CPU fp32, "
                                 "bf16 with AMX), logged with its reason")


@dataclass
class CompressionSection:
    grad: str = opt("none", "gradient codec on the wire (allreduce_compressed; parameter_server: pushes and "
                            "pulled deltas), or rapidfire_adamw's momentum codec; auto picks 1bit or 2bit per tensor "
                            "from its gradient statistics")
    act: Optional[str] = opt(None, "compression of activations saved for backward inside the decoder blocks "
                                   "(null: int8 from memory.optim_level level2 up, else none)")
    keep_fp16: List[str] = opt(["*o_proj*", "*out_proj*", "*c_proj*", "*norm*", "*ln_*", "*.bias"],
                               "parameter-name patterns (fnmatch) whose gradients stay fp16: attention output "
                               "projections, norms, biases; [] compresses everything")
    min_numel: int = opt(4096, "tensors with fewer elements stay fp16 (0: no size rule)")
    chunk_size: int = opt(2048, "elements per scale of the 1bit/2bit codecs")
    auto_interval: int = opt(100, "auto: steps between re-evaluations of each tensor's codec")


@dataclass
class OptimizerParams:
    lr: float = opt(2.0e-5, "peak learning rate")
    weight_decay: float = opt(0.0, "decoupled (AdamW) weight decay")
    betas: List[float] = opt([0.9, 0.999], "Adam beta1, beta2")
    eps: float = opt(1.0e-8, "Adam epsilon")
    freeze_step: Optional[int] = opt(None, "rapidfire_adamw: full-precision warm-up steps before the variance "
                                           "freezes and momentum is exchanged compressed (null: 20% of the run)")
    compression: CompressionSection = field(default_factory=CompressionSection)


@dataclass
class OptimizerSection:
    type: str = opt("adamw", "optimizer: torch AdamW, or the 1-bit Adam variant")
    params: OptimizerParams = field(default_factory=OptimizerParams)


@dataclass
class ElasticSection:
    batch: str = opt("accumulate", "elastic runs (scaling.num_workers [min, max]): how the global batch follows "
                                   "the worker count. accumulate: gradient accumulation x max/workers (the global "
                                   "batch of max workers kept, to the nearest whole step); scale_lr: the learning "
                                   "rate x workers/max (linear scaling rule); none: per-worker batch and learning "
                                   "rate unchanged")
    resize_interval_s: float = opt(60.0, "elastic runs: seconds between two checks for more workers' resources "
                                         "while training (a resize restarts the workers from the latest "
                                         "checkpoint)")


@dataclass
class ScalingSection:
    num_workers: Any = opt(2, "Ray Train workers (one process each); [min, max] for an elastic run that starts "
                              "once min fit, grows to max as nodes join and shrinks (down to min) when nodes "
                              "leave, resuming from its latest checkpoint each time")
    elastic: ElasticSection = field(default_factory=ElasticSection)
    use_gpu: bool = opt(False, "one GPU per worker when true")
    cpus_per_worker: int = opt(1, "CPUs reserved per worker; also its torch thread count")
    placement: str = opt("PACK", "where Ray puts the workers: PACK (fill a node first) or SPREAD (one per node "
                                 "where possible)")
    hybrid_parallel: bool = opt(False, "shard parameters within a node, replicate them across nodes (for models "
                                       "above 20B; see the README for the supported combinations)")
    max_failures: int = opt(0, "worker-group restarts Ray Train may make after a worker dies (each resumes from "
                               "the latest checkpoint); 0 ends the run at the first failure")
    resources_per_worker: Dict[str, float] = field(default_factory=dict, metadata={
        "doc": "extra Ray resources each worker asks for, e.g. {accelerator: 1} for a custom resource or "
               "{GPU: 8} (needs use_gpu); the autoscaler adds nodes that have them ({}: CPUs, and a GPU with "
               "use_gpu)"})
    placement_timeout_s: float = opt(900.0, "seconds the driver waits for the cluster (or its autoscaler) to place "
                                            "every worker, printing what it waits for, before it fails with one "
                                            "line; 0 waits forever")


@dataclass
class ParameterServerSection:
    num_shards: Optional[int] = opt(None, "parameter_server: shard actors, each owning a byte-balanced part of the "
                                          "parameters (null: one per node)")
    max_staleness: int = opt(2, "parameter_server: most updates (versions) a shard may apply between the version a "
                                "worker's gradient was computed on and that gradient's own update")
    snapshot_every: int = opt(100, "parameter_server: a shard writes its state to the run folder every N updates "
                                   "it applies, and restores it after a crash (0: never)")
    lr_staleness_scaling: str = opt("none", "parameter_server: inverse divides an update's learning rate by "
                                            "1 + its staleness")
    lr_per_push: str = opt("mean", "parameter_server: mean applies each worker's push with lr / workers (a push is "
                                   "one worker's share of the global batch: all workers' pushes move the parameters "
                                   "as far as one synchronous step); full applies each push with the whole lr")


@dataclass
class CommunicationSection:
    mode: str = opt("allreduce", "how gradients are exchanged between workers: plain DDP allreduce, a DDP hook "
                                 "exchanging optimizer.params.compression.grad bytes, or parameter-server actors "
                                 "(asynchronous, no allreduce)")
    on_nonfinite: str = opt("skip", "a NaN/inf gradient: skip the step on every worker (counted, named), or fail")
    ps: ParameterServerSection = field(default_factory=ParameterServerSection)


@dataclass
class MemorySection:
    optim_level: str = opt("level0", "level0: none; level1: selective gradient checkpointing sized to the memory "
                                     "budget; level2: + int8 saved activations + allocator defragmentation; "
                                     "level3: + DeepSpeed ZeRO-3 sharding across workers")
    offload_optimizer: bool = opt(False, "level3: keep the optimizer state in CPU memory (ZeRO-Offload)")
    max_forward_tokens: Optional[int] = opt(None, "padded tokens one forward/backward pass may hold; a larger batch is "
                                                  "split into pieces accumulated in the same step (null: whole "
                                                  "batches; a live knob of rapidfire monitor)")


@dataclass
class GuardSection:
    max_consecutive: int = opt(3, "NaN guard: steps in a row with a non-finite loss or gradient (each skipped, "
                                  "parameters unchanged) before the run stops with a diagnosis")


@dataclass
class CheckpointSection:
    every_steps: int = opt(50, "save a Ray Train checkpoint every N optimizer steps (0: only at the end)")
    keep: int = opt(2, "newest checkpoints kept on storage")
    on_preemption: bool = opt(True, "save a checkpoint right after the current step when a node of the run gets a "
                                    "preemption notice (a Ray node drain, e.g. a spot interruption); not with "
                                    "communication.mode parameter_server")


@dataclass
class RewardSection:
    model: Optional[str] = opt(None, "rl: a sequence-classification checkpoint directory scoring prompt + completion "
                                     "text (e.g. the reward stage's runs/<name>/model), hosted by the reward actors; "
                                     "null: rule rewards only")
    model_required: bool = opt(True, "rl: false lets a profile name a reward model an earlier stage may not have "
                                     "written: a missing rl.reward.model directory is then skipped (rule rewards "
                                     "only), with a warning")
    functions: List[str] = opt(["answer_match"], "rl: built-in rule rewards added to the model's score: "
                                                 "answer_match (1.0 when the completion states the row's `answer`)")
    weights: Dict[str, float] = field(default_factory=dict, metadata={
        "doc": "rl: weight of each reward in the sum, by name ('model' or a function name); unnamed ones weigh 1"})
    num_actors: int = opt(1, "rl: reward-model actors in the pool, each holding one copy of the model")
    batch_size: int = opt(16, "rl: (prompt, completion) pairs one actor scores per call")
    use_gpu: bool = opt(False, "rl: one GPU per reward actor (the pool may sit on other GPUs or nodes than the "
                               "policy workers)")
    cpus_per_actor: float = opt(1.0, "rl: CPUs reserved per reward actor (also its torch thread count, at least 1)")
    resources: Dict[str, float] = field(default_factory=dict, metadata={
        "doc": "rl: extra Ray resources each reward actor asks for, e.g. {reward_node: 1} to place the pool on the "
               "nodes that advertise that resource"})
    max_restarts: int = opt(3, "rl: times Ray restarts a dead reward actor; the batch it held is scored again")


@dataclass
class PPOSection:
    epochs: int = opt(4, "ppo: passes over each rollout batch")
    minibatch_size: int = opt(4, "ppo: completions per worker per update (divides train.per_device_batch_size)")
    clip_range: float = opt(0.2, "ppo: policy ratio clip epsilon")
    value_clip_range: float = opt(0.2, "ppo: value prediction clip around the rollout's values")
    gamma: float = opt(1.0, "ppo: discount per token")
    lam: float = opt(0.95, "ppo: GAE lambda")
    vf_coef: float = opt(0.1, "ppo: weight of the value loss in the total loss")
    value_init: str = opt("auto", "ppo: value model initialised from the reward model (reward), the policy's base "
                                  "model (policy), or auto: the reward model when rl.reward.model is set")


@dataclass
class RLSection:
    algorithm: str = opt("grpo", "train.stage rl: GRPO or RLOO (TRL's trainers) or classic PPO with a value model")
    num_generations: int = opt(4, "completions sampled per prompt (grpo/rloo: the group compared); "
                                  "train.per_device_batch_size counts completions and must be a multiple of it")
    max_new_tokens: int = opt(64, "most tokens generated per completion; prompts may use data.max_length minus this")
    temperature: float = opt(1.0, "sampling temperature of the rollouts")
    kl_beta: float = opt(0.04, "weight of the KL penalty to a frozen reference copy of the starting policy "
                               "(0: no reference model)")
    eval_path: Optional[str] = opt(None, "held-out prompts (data.format prompt): task score (answer_match) and mean "
                                         "reward of the policy before and after training, greedy decoding")
    eval_max_prompts: int = opt(64, "held-out prompts evaluated at most")
    reward: RewardSection = field(default_factory=RewardSection)
    ppo: PPOSection = field(default_factory=PPOSection)


@dataclass
class MonitorSection:
    adjust: str = opt("off", "auto: rules change the knobs in monitor.allowed while the run trains, each change "
                             "logged with its reason; off: only watch (--adjust_parameters on train and monitor)")
    allowed: List[str] = opt(["data.prefetch_depth", "memory.max_forward_tokens"],
                             "knobs the rules may change (data.prefetch_depth, memory.max_forward_tokens, and with "
                             "allreduce_compressed optimizer.params.compression.grad); [] none")
    interval_s: float = opt(1.0, "seconds between two evaluations of the rules on the workers' step records")
    window_steps: int = opt(4, "steps (of every worker) a rule looks at; a changed knob is judged again only "
                               "after a full window with its new value")
    data_wait_fraction: float = opt(0.05, "data wait above this share of step time doubles data.prefetch_depth")
    max_prefetch_depth: int = opt(16, "the prefetch rule raises data.prefetch_depth up to this")
    oom_splits: int = opt(2, "this many out-of-memory batch splits in a window halve memory.max_forward_tokens")
    memory_headroom: float = opt(0.5, "peak memory below this share of every worker's memory (and no split) doubles "
                                      "memory.max_forward_tokens again, up to whole batches")
    comm_latency_p99_s: float = opt(0.5, "comm latency p99 above this (seconds): the next stronger codec where "
                                         "optimizer.params.compression.grad is an allowed live knob "
                                         "(allreduce_compressed), otherwise advice (a stronger codec or a larger "
                                         "staleness bound)")


@dataclass
class PipelineSection:
    stages: List[str] = opt(["sft", "reward", "rl"], "train.stage pipeline: the stages to run, in this order, each "
                                                     "from the previous one's model")
    sft: Dict[str, Any] = field(default_factory=dict, metadata={
        "doc": "pipeline: config sections for the SFT stage on top of this file's (e.g. {train: {max_steps: 30}})"})
    reward: Dict[str, Any] = field(default_factory=dict, metadata={
        "doc": "pipeline: config sections for the reward stage (its preference data, data.format preference); "
               "model.name defaults to the SFT stage's model"})
    rl: Dict[str, Any] = field(default_factory=dict, metadata={
        "doc": "pipeline: config sections for the RL stage (its prompts, rl.*); the policy defaults to the SFT "
               "model, rl.reward.model to the reward stage's model"})


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
    guard: GuardSection = field(default_factory=GuardSection)
    rl: RLSection = field(default_factory=RLSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)


# key -> the values it accepts
CHOICES = {
    "scaling.elastic.batch": ("accumulate", "scale_lr", "none"),
    "monitor.adjust": ("auto", "off"),
    "data.format": ("text", "prompt_completion", "messages", "oasst", "prompt", "preference"),
    "data.on_bad_row": ("skip", "fail"),
    "data.overlong": ("truncate", "drop"),
    "data.dynamic_batch.strategy": ("fixed", "token_budget", "memory_aware"),
    "train.stage": ("sft", "rl", "reward", "pipeline"),
    "train.lr_scheduler": ("constant", "linear", "cosine"),
    "train.precision": ("auto", "fp32", "fp16", "bf16", "fp8"),
    "optimizer.type": ("adamw", "rapidfire_adamw"),
    "optimizer.params.compression.grad": ("none", "fp16", "1bit", "2bit", "auto"),
    "optimizer.params.compression.act": ("none", "int8", None),
    "communication.mode": ("allreduce", "allreduce_compressed", "parameter_server"),
    "communication.ps.lr_staleness_scaling": ("none", "inverse"),
    "communication.ps.lr_per_push": ("mean", "full"),
    "communication.on_nonfinite": ("skip", "fail"),
    "scaling.placement": ("PACK", "SPREAD"),
    "memory.optim_level": ("level0", "level1", "level2", "level3"),
    "rl.algorithm": ("grpo", "rloo", "ppo"),
    "rl.ppo.value_init": ("auto", "reward", "policy"),
}

# key -> (lowest allowed, highest allowed or None), inclusive
RANGES = {
    "memory.max_forward_tokens": (8, None),
    "monitor.interval_s": (0.1, 3600.0),
    "monitor.window_steps": (1, None),
    "monitor.data_wait_fraction": (0.0, 1.0),
    "monitor.max_prefetch_depth": (1, 64),
    "monitor.oom_splits": (1, None),
    "monitor.memory_headroom": (0.0, 1.0),
    "monitor.comm_latency_p99_s": (0.0, None),
    "run.seed": (0, 2**32 - 1),
    "data.max_length": (8, None),
    "data.prefetch_depth": (0, 64),
    "data.dynamic_batch.min": (1, None),
    "data.dynamic_batch.max": (1, None),
    "data.dynamic_batch.max_tokens": (8, None),
    "data.dynamic_batch.window": (1, None),
    "data.dynamic_batch.max_padding": (0.0, 1.0),
    "data.dynamic_batch.memory_threshold": (0.0, 1.0),  # 0 itself is refused in load.validate
    "train.epochs": (0.001, None),
    "train.per_device_batch_size": (1, None),
    "train.gradient_accumulation_steps": (1, None),
    "train.grad_clip": (0.0, None),
    "train.warmup_steps": (0, None),
    "train.log_every_steps": (1, None),
    "optimizer.params.lr": (0.0, 1.0),
    "optimizer.params.weight_decay": (0.0, 1.0),
    "optimizer.params.eps": (0.0, 1.0),
    "optimizer.params.freeze_step": (1, None),
    "optimizer.params.compression.min_numel": (0, None),
    "optimizer.params.compression.chunk_size": (8, None),
    "optimizer.params.compression.auto_interval": (1, None),
    "scaling.elastic.resize_interval_s": (1.0, None),
    "scaling.cpus_per_worker": (1, None),
    "scaling.max_failures": (0, None),
    "scaling.placement_timeout_s": (0.0, None),
    "communication.ps.num_shards": (1, None),
    "communication.ps.max_staleness": (0, None),
    "communication.ps.snapshot_every": (0, None),
    "checkpoint.every_steps": (0, None),
    "guard.max_consecutive": (1, None),
    "checkpoint.keep": (1, None),
    "rl.num_generations": (1, None),
    "rl.max_new_tokens": (1, None),
    "rl.temperature": (0.01, 10.0),
    "rl.kl_beta": (0.0, None),
    "rl.eval_max_prompts": (1, None),
    "rl.reward.num_actors": (1, None),
    "rl.reward.batch_size": (1, None),
    "rl.reward.cpus_per_actor": (0.0, None),
    "rl.reward.max_restarts": (0, None),
    "rl.ppo.epochs": (1, None),
    "rl.ppo.minibatch_size": (1, None),
    "rl.ppo.clip_range": (0.0, 10.0),
    "rl.ppo.value_clip_range": (0.0, None),
    "rl.ppo.gamma": (0.0, 1.0),
    "rl.ppo.lam": (0.0, 1.0),
    "rl.ppo.vf_coef": (0.0, None),
}



def reference_markdown() -> str:
    """The config reference as a Markdown table (docs/config.md is this output)."""
    lines = ["| key | default | allowed | meaning |", "|---|---|---|---|"]

    def walk(cls, prefix: str) -> None:
        for f in fields(cls):
            key = f"{prefix}{f.name}"
            if f.default_factory is not MISSING_FACTORY and is_dataclass(f.default_factory()):
                walk(type(f.default_factory()), f"{key}.")
                continue
            default = f.default_factory() if f.default is MISSING_DEFAULT else f.default
            if key in CHOICES:
                allowed = ", ".join("`null`" if v is None else f"`{v}`" for v in CHOICES[key])
            elif key in RANGES:
                low, high = RANGES[key]
                allowed = f">= {low}" if high is None else f"{low} .. {high}"
            else:
                allowed = ""
            shown = "null" if default is None else default
            lines.append(f"| `{key}` | `{shown}` | {allowed} | {f.metadata.get('doc', '')} |")

    walk(RapidfireConfig, "")
    return "\n".join(lines) + "\n"
