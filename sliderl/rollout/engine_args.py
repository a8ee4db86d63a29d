"""``EngineArgs``: every setting of the generation engine (``rollout.LLM``), declared once.

A frozen stdlib dataclass, so ``rollout`` imports without pydantic while the job config validates
it directly (``__pydantic_config__``: unknown keys are rejected, each field's docstring is its help).
``LLM(model, kv=..., device=..., ...)`` builds one from its keywords; ``llm.args`` is the record.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace
from typing import ClassVar

from sliderl.core.kv_policy import KVPolicy
from sliderl.core.loader import DTYPES
from sliderl.core.restart import SummaryTool

DEVICE_PATTERN = r"cpu|cuda(:\d+)?"


@dataclass(frozen=True)
class EngineArgs:
    """The KV policy, the paged pool, the batch limits and the device of one generation engine."""

    __pydantic_config__: ClassVar[dict] = {"extra": "forbid", "use_attribute_docstrings": True}

    kv: str = "full"
    """KV retention policy: full, prefix_sliding:W, sliding_window:W, streaming:S:W, registers:N, h2o:B (B >= 2 x block_size), pasta, planned_diffusion, or a restart baseline (canonicalised): last_k:N:K (the generated part of the context holds at most N tokens; then it restarts from the prompt and the last K generated tokens, 1 <= K < N) or summary:N:S (the model summarises its reasoning in a tool call of at most S tokens, forced when S tokens are left, then restarts from the prompt with the summary inserted; 2 <= S < N)."""
    device: str = "cpu"
    """Where the engine runs: cpu, cuda or cuda:N."""
    dtype: str = "float32"
    """Weight and KV dtype: float32, bfloat16 or float16."""
    block_size: int = 16
    """Token slots per KV block (>= 1)."""
    num_blocks: int | None = None
    """Blocks in the KV pool (>= 1); None sizes the pool from kv_cache_gb."""
    kv_cache_gb: float | None = None
    """KV pool size in GiB (> 0) if num_blocks is None; None: 1 on CPU, on CUDA 90% of free memory less 4."""
    max_num_seqs: int = 64
    """Most sequences scheduled in one engine step (>= 1)."""
    max_num_batched_tokens: int = 1024
    """Most tokens (prefill + decode) in one engine step (>= 1)."""
    kv_watermark: float = 0.01
    """Pool fraction (0 <= x < 1) left free by an admission under full/registers; bounded policies admit by block bound."""
    max_model_len: int | None = None
    """Longest sequence, prompt + completion (>= 1); None takes the model's max_position_embeddings."""
    seed: int = 0
    """Engine seed; a request without its own seed derives one from it and its request index."""
    cuda_graphs: bool = True
    """On CUDA, replay decode steps as captured CUDA graphs, and under kv=planned_diffusion its denoising forwards padded to buckets (on CPU those run padded, eagerly); outputs are the same without."""
    overlap: bool | None = None
    """Queue each decode step before the previous one's tokens are read back; None: on for CUDA."""
    gemv: bool = False
    """On CUDA, run linear layers and the lm_head over at most 8 tokens with the Triton split-K GEMV instead of cuBLAS. Off: no faster than cuBLAS at batch 1 on the H200 (463 against 472 tok/s at 9491d1c; per layer 0.81-1.06x cuBLAS: docs/results.md, "Engine speed")."""
    pdl: bool = False
    """On a CUDA GPU of compute capability 9.0+ (Hopper), launch the decode step's Triton kernels as a programmatic-dependent-launch chain: each kernel prefetches its weights (or live K/V) into L2 while the one before it finishes (kernels/pdl.py). Off until measured faster."""
    pasta_max_forks: int = 8
    """kv=pasta: most forks per request (>= 0); a promise past it is plain text. Each fork may hold max_tokens + 2 tokens of KV, which the request's block bound counts."""
    pd_steps_ratio: float = 1.0
    """kv=planned_diffusion: denoising steps per span token, in (0, 1]; a span of L tokens takes ceil(ratio x L) steps (1: one token a step)."""
    pd_confidence: float | None = None
    """kv=planned_diffusion: also reveal, at once, every masked position whose most likely token has at least this probability, in (0, 1]; None: off."""
    pd_order: str = "entropy"
    """kv=planned_diffusion: which masked positions a step reveals first: entropy (lowest predicted entropy) or uniform (random)."""

    summary_tool: SummaryTool = SummaryTool()
    """kv=summary:N:S: the summary tool call (its tokens, name, JSON wrapping) and the template that inserts the summary into the prompt; the paper's defaults (its Figures 16-17)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv", KVPolicy.parse(self.kv).spec)
        if isinstance(self.summary_tool, dict):
            object.__setattr__(self, "summary_tool", SummaryTool(**self.summary_tool))
        if not isinstance(self.summary_tool, SummaryTool):
            raise ValueError(f"summary_tool must be a SummaryTool, got {self.summary_tool!r}")
        if not isinstance(self.device, str) or not re.fullmatch(DEVICE_PATTERN, self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_int(name, getattr(self, name), optional=False)
        for name in ("num_blocks", "max_model_len"):
            _check_int(name, getattr(self, name), optional=True)
        policy = KVPolicy.parse(self.kv)
        if policy.kind == "h2o":
            policy.budget_pages(self.block_size)  # raises when B is under two pages
        gb = self.kv_cache_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float))
                               or not 0 < gb < math.inf):
            raise ValueError(f"kv_cache_gb must be None or a finite number > 0, got {gb!r}")
        mark = self.kv_watermark
        if isinstance(mark, bool) or not isinstance(mark, (int, float)) or not 0 <= mark < 1:
            raise ValueError(f"kv_watermark must be a fraction of the KV pool, 0 <= x < 1, got {mark!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if not isinstance(self.gemv, bool):
            raise ValueError(f"gemv must be true or false, got {self.gemv!r}")
        if not isinstance(self.pdl, bool):
            raise ValueError(f"pdl must be true or false, got {self.pdl!r}")
        if self.pdl and not self.device.startswith("cuda"):
            raise ValueError(f"pdl needs a CUDA device of compute capability 9.0 or later (Hopper), got device={self.device!r}")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be None, true or false, got {self.overlap!r}")
        forks = self.pasta_max_forks
        if isinstance(forks, bool) or not isinstance(forks, int) or forks < 0:
            raise ValueError(f"pasta_max_forks must be an integer >= 0, got {forks!r}")
        ratio, confidence = self.pd_steps_ratio, self.pd_confidence
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"pd_steps_ratio must be in (0, 1] (denoising steps per span token), got {ratio!r}")
        if confidence is not None and (isinstance(confidence, bool) or not isinstance(confidence, (int, float))
                                       or not 0 < confidence <= 1):
            raise ValueError(f"pd_confidence must be None or in (0, 1], got {confidence!r}")
        if self.pd_order not in ("entropy", "uniform"):
            raise ValueError(f"pd_order must be entropy or uniform, got {self.pd_order!r}")

    @classmethod
    def from_keywords(cls, base: EngineArgs | None = None, **keywords) -> EngineArgs:
        """``base`` (default: the library defaults) with ``keywords`` replacing its fields.

        An unknown keyword raises TypeError naming it and listing the valid ones.
        """
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            raise TypeError(f"unknown engine argument(s) {', '.join(unknown)}; valid: {', '.join(names)}")
        return replace(base if base is not None else cls(), **keywords)


def _check_int(name: str, value, optional: bool) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        valid = "None or an integer >= 1" if optional else "an integer >= 1"
        raise ValueError(f"{name} must be {valid}, got {value!r}")
