"""What the Learner reports: ``StepMetrics`` of one optimizer step and the ``Evaluation`` of teacher-forced scores.
Plain records, so the driver and the monitor read them without torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class StepMetrics:
    """What one ``Learner.step`` did; the field names are the metric names.

    The mismatch fields compare recomputed and sampler logprobs on the loss tokens
    (``trainer.logprobs.Mismatch``); they are None when no trained trace carried sampler logprobs
    (SFT data) or nothing was stepped.
    """

    loss: float  # the step's loss (0 when not stepped)
    grad_norm: float  # before clipping
    kl_mismatch: float | None  # mean k3 of recomputed vs sampler logprobs
    kl_mismatch_k1: float | None  # mean (sampler - recomputed)
    logprob_diff_max: float | None  # largest |sampler - recomputed|
    num_tokens: int  # model inputs over all micro-batches
    num_loss_tokens: int
    num_traces: int  # traces with at least one loss token
    num_windows: int
    num_micro_batches: int
    skipped_traces_no_loss: int  # selected traces without a loss token (all forced)
    step_seconds: float
    version: int  # the learner's version after the step
    stepped: bool  # False when no group carried a training signal (version kept)
    lr: float  # the learning rate of this step
    algorithm: dict[str, float] = field(default_factory=dict)  # selection counts, token-weighted loss metrics
    peak_memory_gib: float | None = None  # CUDA: max_memory_allocated during the step (weights, optimizer state
                                          # and activations), the most of any rank; None on CPU
    rank_peak_memory_gib: tuple[float, ...] | None = None  # CUDA: each rank's peak, in rank order; None on CPU

    def as_dict(self) -> dict[str, float]:
        """Flat floats, the algorithm's entries merged in, bools as 0/1, absent (None) fields left out; each
        rank's peak memory as ``peak_memory_gib/rank<i>``."""
        out = {k: float(v) for k, v in asdict(self).items()
               if k not in ("algorithm", "rank_peak_memory_gib") and v is not None}
        ranks = {f"peak_memory_gib/rank{i}": float(v) for i, v in enumerate(self.rank_peak_memory_gib or ())}
        return {**out, **ranks, **self.algorithm}


@dataclass(frozen=True)
class Evaluation:
    """Teacher-forced scores over the loss tokens of some traces (``Learner.evaluate``)."""

    loss: float  # mean NLL per loss token (nats, temperature 1)
    token_accuracy: float  # fraction of loss tokens that are the model's argmax
    exact_match: float  # fraction of traces whose every loss token is the argmax (= greedy decoding reproduces it)
    num_traces: int  # traces with at least one loss token
