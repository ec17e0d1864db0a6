"""`memory.optim_level` (CLI `--memory_optim`): what each level turns on.

| level  | turns on                                                                                   |
|--------|--------------------------------------------------------------------------------------------|
| level0 | nothing: every activation kept in full, parameters replicated on every worker             |
| level1 | selective gradient checkpointing: as many decoder blocks as the memory budget needs        |
| level2 | level1 + int8 saved activations in the decoder blocks + allocator defragmentation (CUDA)  |
| level3 | level2 + DeepSpeed ZeRO-3: parameters, gradients and optimizer state sharded over workers |

`optimizer.params.compression.act` overrides the level's activation choice (`int8` at level0 or
level1 compresses activations without checkpointing; `none` at level2 or 3 turns it off).
`scaling.hybrid_parallel` shards within a node and replicates across nodes (ZeRO-3 with
hierarchical partitioning) and implies level3's sharding.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

LEVELS = ("level0", "level1", "level2", "level3")


@dataclass(frozen=True)
class MemoryOptions:
    level: str
    checkpointing: bool  # selective, sized to the budget
    act: str  # none | int8
    defragment: bool  # CUDA allocator: expandable segments, free cached blocks and retry once on OOM
    zero_stage: int  # 0 (none) or 3
    offload_optimizer: bool
    hybrid: bool

    @classmethod
    def from_config(cls, cfg: dict) -> MemoryOptions:
        """`cfg`: the resolved config (dict or DictConfig)."""
        mem = cfg["memory"]
        n = LEVELS.index(mem["optim_level"])
        act = cfg["optimizer"]["params"]["compression"]["act"]
        hybrid = bool(cfg["scaling"]["hybrid_parallel"])
        return cls(level=mem["optim_level"], checkpointing=n >= 1, act=act if act is not None else
                   ("int8" if n >= 2 else "none"), defragment=n >= 2, zero_stage=3 if n >= 3 or hybrid else 0,
                   offload_optimizer=bool(mem["offload_optimizer"]), hybrid=hybrid)

    def describe(self) -> str:
        parts = []
        if self.checkpointing:
            parts.append("selective gradient checkpointing")
        if self.act != "none":
            parts.append(f"{self.act} saved activations")
        if self.defragment:
            parts.append("allocator defragmentation")
        if self.zero_stage:
            parts.append("ZeRO-3 " + ("within each node, replicated across nodes" if self.hybrid else
                                      "across all workers") + (" with the optimizer state on CPU"
                                                               if self.offload_optimizer else ""))
        return f"memory {self.level}: " + (", ".join(parts) if parts else "no memory optimisation")

    def to_dict(self) -> dict:
        return asdict(self)
