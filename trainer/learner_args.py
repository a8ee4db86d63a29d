"""STUB (lead's placeholder until the trainer branch merges): LearnerArgs record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from trainer.algorithms import AlgorithmOptions, GRPOOptions

_CONFIG = {"extra": "forbid", "use_attribute_docstrings": True}


@dataclass(frozen=True)
class LearnerArgs:
    """The learner's settings."""

    __pydantic_config__: ClassVar[dict] = _CONFIG

    algo: AlgorithmOptions = field(default_factory=GRPOOptions)
    """The algorithm and its options (type: grpo | bonbon | sft)."""
    lr: float = 1e-5
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    lr_schedule: str = "constant"
    """constant or cosine."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    total_steps: int | None = None
    """Cosine horizon."""
    min_lr_ratio: float = 0.1
    """Cosine floor."""
    window_mode: str = "truncated"
    """truncated, chunked or full."""
    multiplier: int = 4
    """k of the truncated window."""
    window: int | None = None
    """W override."""
    micro_batch_tokens: int = 8192
    """Tokens per micro-batch."""
    attention: str = "auto"
    """auto, flex, sdpa, dense."""
    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    dtype: str = "float32"
    """Parameter dtype."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward."""
    seed: int = 0
    """Torch seed of the learner."""
    reference_model_path: str | None = None
    """Frozen reference; None: the initial model."""
    vocab_policy: str | None = None
    """Policy whose vocabulary to prepare before step 1."""

    def __post_init__(self) -> None:
        pass
