"""``LearnerArgs``: every setting of ``trainer.learner.Learner``, declared once with its default.

A frozen stdlib dataclass (``trainer/`` imports without pydantic); the job config validates it
directly (``__pydantic_config__``: unknown keys are errors, the field docstrings are the help).
A checkpoint stores ``dataclasses.asdict(args)``; ``LearnerArgs.from_dict`` rebuilds it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from sliderl.core.kv_policy import KVPolicy
from sliderl.core.loader import DTYPES
from sliderl.trainer.algorithms import RECORD_CONFIG, AlgorithmOptions, GRPOOptions, options_from_dict, require_field
from sliderl.trainer.attention import ATTENTION_BACKENDS
from sliderl.trainer.windows import WINDOW_MODES

LR_SCHEDULES = ("constant", "cosine")
OFFLOADS = ("none", "cpu")
REDUCE_DTYPES = ("float32", "bfloat16")
GRADIENT_SYNCS = ("micro_batch", "step")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class LearnerArgs:
    """The learner's settings: algorithm, optimizer and schedule, windows, placement."""

    __pydantic_config__: ClassVar[dict] = RECORD_CONFIG
    algo: AlgorithmOptions = GRPOOptions()
    """The algorithm and its options, chosen by ``type``: grpo, bonbon, sft or planned_diffusion."""
    lr: float = 1e-5
    """Peak AdamW learning rate (>= 0)."""
    weight_decay: float = 0.0
    """AdamW weight decay (>= 0)."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (> 0)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """constant: lr after the warm-up; cosine: decay from lr to min_ratio·lr at total_steps."""
    warmup_steps: int = 0
    """Steps of linear warm-up from lr/warmup_steps to lr (>= 0)."""
    total_steps: int | None = None
    """Horizon of the cosine decay in optimizer steps (> 0; required by cosine); None with constant."""
    min_lr_ratio: float = 0.1
    """The cosine's final lr as a fraction of lr, in [0, 1]."""
    window_mode: Literal["truncated", "chunked", "full"] = "truncated"
    """truncated: loss on the last W tokens with k·W of context; chunked: every token once, windows
    accumulated; full: the whole trace."""
    multiplier: int = 4
    """k of the truncated window: the context is k·W generated tokens (>= 1)."""
    window: int | None = None
    """W of the training windows (>= 1); None: the trace policy's window (whole trace for full/registers)."""
    micro_batch_tokens: int = 8192
    """Input tokens per forward/backward micro-batch (>= 1); a window larger than this goes alone."""
    attention: Literal["auto", "flex", "sdpa", "dense"] = "auto"
    """Training attention backend (``trainer.attention``); auto: flex on CUDA, sdpa on CPU."""
    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the trained model (and of AdamW's state)."""
    master_weights: bool = False
    """With dtype bfloat16/float16: AdamW steps float32 copies of the weights (its moments in float32 too) and
    rounds them into the model after each step (``trainer.optimizer``); without it an update below half a
    bf16 spacing is lost (lr 1e-6 never moves a weight of 0.02). +12 bytes per parameter."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in backward to save memory."""
    checkpoint_layers: int | None = None
    """With gradient_checkpointing: recompute only the first K decoder layers (all of them when K >= the model's
    layer count); the others keep their activations, trading their memory for their forward's second run.
    None: every layer."""
    compile_elementwise: bool | Literal["auto"] = "auto"
    """Run each layer's element-wise chains (the norms with their residual adds, q/k-norm + RoPE, SiLU·mul) and
    the LM head's logprob chunks (``trainer.logprobs.head_logprobs``) as
    ``torch.compile``d graphs, forward and backward fused (``core.model.DecoderLM``): eager, those chains were 28%
    of a 1.7B GRPO step's device time on the H200; compiled, the truncated 32K step took 5.21 s instead of 8.18 on
    an H100 (docs/results.md, "Learner"). The first micro-batch compiles them (seconds); the math is the eager
    path's. auto: on where the learner runs on CUDA, off on the CPU (where inductor needs a C++ compiler and the
    tiny models gain nothing)."""
    offload: Literal["none", "cpu"] = "none"
    """Sharded learner (FSDP2): cpu keeps the sharded parameters (float32 masters), their gradients and AdamW's
    state in CPU memory and steps there (FSDP2's CPUOffloadPolicy; each layer is copied to the GPU for its
    forward and backward): the GPU then holds only activations and one layer at a time. Needs a CUDA device."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Sharded learner: the dtype gradients are summed over ranks in (bfloat16 halves that traffic)."""
    gradient_sync: Literal["micro_batch", "step"] = "micro_batch"
    """Sharded learner: when gradients are summed over ranks into their shards (and, with offload, copied to host
    memory). micro_batch: after each micro-batch's backward; step: once, after the step's last (FSDP2's
    ``set_requires_gradient_sync``): until then each rank adds its micro-batches' gradients unsharded on its GPU,
    in reduce_dtype — +4 bytes per parameter per rank (30 GB at 7B) for one reduce-scatter (and one host copy) a
    step instead of one a micro-batch. The one-process learner accumulates in place either way."""
    seed: int = 0
    """torch seed set when the learner starts."""
    reference_model_path: str | None = None
    """Frozen reference for BoNBoN and GRPO's KL; None: the model the learner starts from."""
    vocab_policy: str | None = None
    """A KV policy spec whose tokens the vocabulary must hold before step 1 (e.g. registers:16); it
    decides no mask: each trace is trained under its own kv_policy."""

    def __post_init__(self) -> None:
        if isinstance(self.algo, dict):
            object.__setattr__(self, "algo", options_from_dict(self.algo))
        object.__setattr__(self, "adam_betas", tuple(self.adam_betas))
        require_field(self, "lr", self.lr >= 0 and math.isfinite(self.lr), "a finite number >= 0")
        require_field(self, "weight_decay", self.weight_decay >= 0, ">= 0")
        require_field(self, "adam_betas", len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
                 "two numbers in [0, 1)")
        require_field(self, "max_grad_norm", self.max_grad_norm > 0, "> 0")
        require_field(self, "lr_schedule", self.lr_schedule in LR_SCHEDULES, f"one of {', '.join(LR_SCHEDULES)}")
        require_field(self, "warmup_steps", self.warmup_steps >= 0, ">= 0")
        require_field(self, "total_steps", self.total_steps is None or self.total_steps > 0, "> 0 or None")
        if self.lr_schedule == "cosine" and self.total_steps is None:
            raise ValueError("total_steps must be > 0 with lr_schedule 'cosine' (the decay's horizon), got None")
        require_field(self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]")
        require_field(self, "window_mode", self.window_mode in WINDOW_MODES, f"one of {', '.join(WINDOW_MODES)}")
        require_field(self, "multiplier", self.multiplier >= 1, ">= 1")
        require_field(self, "window", self.window is None or self.window >= 1, ">= 1 or None")
        require_field(self, "checkpoint_layers", self.checkpoint_layers is None or self.checkpoint_layers >= 0,
                      ">= 0 or None")
        if self.checkpoint_layers is not None and not self.gradient_checkpointing:
            raise ValueError(f"checkpoint_layers ({self.checkpoint_layers}) needs gradient_checkpointing: true (it "
                             f"says how many layers recompute); set both, or leave checkpoint_layers None")
        require_field(self, "micro_batch_tokens", self.micro_batch_tokens >= 1, ">= 1")
        require_field(self, "attention", self.attention in ATTENTION_BACKENDS, f"one of {', '.join(ATTENTION_BACKENDS)}")
        require_field(self, "device", bool(_DEVICE.fullmatch(self.device)), "cpu, cuda or cuda:N")
        require_field(self, "dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}")
        require_field(self, "offload", self.offload in OFFLOADS, f"one of {', '.join(OFFLOADS)}")
        if self.offload != "none" and not self.device.startswith("cuda"):
            raise ValueError(f"offload must be 'none' with device {self.device!r} (it moves GPU state to the "
                             f"CPU; the learner is on the CPU already), got {self.offload!r}")
        require_field(self, "reduce_dtype", self.reduce_dtype in REDUCE_DTYPES, f"one of {', '.join(REDUCE_DTYPES)}")
        require_field(self, "gradient_sync", self.gradient_sync in GRADIENT_SYNCS,
                      f"one of {', '.join(GRADIENT_SYNCS)}")
        if self.vocab_policy is not None:
            object.__setattr__(self, "vocab_policy", KVPolicy.parse(self.vocab_policy).spec)
        if self.algo.type == "bonbon" and self.window_mode == "chunked":
            raise ValueError("window_mode must be 'truncated' or 'full' with bonbon (it needs each trace's whole "
                             "loss in one window), got 'chunked'")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0 = the first): linear warm-up ``lr·(step+1)/warmup``,
        then ``lr`` (constant) or a cosine from ``lr`` to ``min_lr_ratio·lr`` at ``total_steps`` (held after)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        ratio = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * ratio

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LearnerArgs:
        """The record from ``dataclasses.asdict`` output (a checkpoint's); unknown keys are an error."""
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ValueError(f"unknown learner setting(s) {unknown}; valid: {sorted(valid)}")
        return cls(**data)


def compiles_elementwise(setting: bool | str, device) -> bool:
    """``LearnerArgs.compile_elementwise`` resolved for a learner on ``device`` (a ``torch.device``): auto is on
    for CUDA only."""
    return device.type == "cuda" if setting == "auto" else bool(setting)
