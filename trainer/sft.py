"""STUB (lead's placeholder until the trainer branch merges): SFTArgs record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class SFTArgs:
    """How an SFT stage runs."""

    __pydantic_config__: ClassVar[dict] = {"extra": "forbid", "use_attribute_docstrings": True}

    steps: int = 1000
    """Most optimizer steps."""
    batch_size: int = 16
    """Examples per step."""
    check_every: int = 25
    """Steps between held-out checks."""
    target_accuracy: float = 0.0
    """Stop at the first check whose held-out exact match reaches this; 0 trains all steps."""
    log_every: int = 0
    """Print every this many steps; 0 = never."""
