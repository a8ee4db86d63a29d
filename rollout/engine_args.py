"""STUB (lead's placeholder until the engine branch merges): EngineArgs record."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from rollout.kv_policy import KVPolicy


@dataclass(frozen=True)
class EngineArgs:
    """Arguments of the generation engine."""

    __pydantic_config__: ClassVar[dict] = {"extra": "forbid", "use_attribute_docstrings": True}

    kv: str = "full"
    """KV retention policy: full, prefix_sliding:W, sliding_window:W, streaming:S:W or registers:N."""
    device: str = "cpu"
    """Where the engine runs: cpu, cuda or cuda:N."""
    dtype: str = "float32"
    """Weight and KV dtype: float32, bfloat16 or float16."""
    block_size: int = 16
    """Token slots per KV block."""
    num_blocks: int | None = None
    """Blocks in the KV pool; None sizes the pool from kv_cache_gb."""
    kv_cache_gb: float | None = None
    """KV pool size in GiB when num_blocks is None; None lets the engine choose."""
    max_num_seqs: int = 64
    """Most sequences scheduled in one engine step."""
    max_num_batched_tokens: int = 1024
    """Most tokens (prefill + decode) in one engine step."""
    max_model_len: int | None = None
    """Longest sequence (prompt + completion); None takes the model's own limit."""
    seed: int = 0
    """Engine seed; requests without their own seed derive one from it and their index."""
    cuda_graphs: bool = True
    """Replay decode steps as CUDA graphs (CUDA only)."""
    overlap: bool | None = None
    """Queue the next decode step before reading this one's tokens; None: on for CUDA except registers."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv", KVPolicy.parse(self.kv).spec)
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
