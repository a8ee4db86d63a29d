"""Training windows: which tokens of a trace the learner feeds, scores and puts a loss on (Prefix Sliding §2).

A trace is a prompt of P tokens (positions ``0..P-1``) and T generated tokens (completion index
``j`` sits at position ``P + j``). A ``TrainingWindow`` selects generated tokens ``j in [s, e)`` as
*targets* (their logprobs are recomputed) and puts the loss on ``j in [l, e)``, ``s <= l < e``.

To score target ``j`` the model needs the token before it (position ``P + j - 1``) as an input, so a
window feeds the prompt plus the predecessor of every target, all at their original positions:

    input positions  = [0, P)  ∪  [P + s - 1, P + e - 1)     (the two ranges share P - 1 when s = 0)
    target positions = [P + s, P + e)
    logits at input position p score the token at position p + 1

Truncated (the default, the paper's setting): the targets are the last ``min(T, k·W)`` generated
tokens and the loss covers the last ``W`` of them, or all of them when nothing was cut (T <= k·W).
With W = 2048, k = 4 and T = 100,000 the model sees the prompt plus 8,192 generated positions and
the loss covers the final 2,048, exactly the paper's example.

Chunked: windows of ``W`` loss tokens laid back from the end of the trace (the last chunk is the
truncated window), each with up to ``(k - 1)·W`` targets of context before its loss tokens, so every
generated token gets a loss exactly once. Full: one window, every generated token a target with loss.

Budget-forced tokens (``Trace.forced``) are never in a loss mask: the sampler did not choose them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WINDOW_MODES = ("truncated", "chunked", "full")


@dataclass(frozen=True)
class TrainingWindow:
    """Targets ``[target_start, target_end)`` and loss ``[loss_start, target_end)`` in completion indices."""

    prompt_len: int  # P
    num_generated: int  # T
    target_start: int  # s
    loss_start: int  # l
    target_end: int  # e

    def __post_init__(self) -> None:
        p, t, s, l, e = self.prompt_len, self.num_generated, self.target_start, self.loss_start, self.target_end
        if p < 1:
            raise ValueError(f"a training window needs a prompt of at least one token, got prompt_len={p}")
        if not 0 <= s <= l < e <= t:
            raise ValueError(f"training window needs 0 <= target_start <= loss_start < target_end <= "
                             f"num_generated, got {s}, {l}, {e}, {t}")

    @property
    def num_targets(self) -> int:
        return self.target_end - self.target_start

    @property
    def num_inputs(self) -> int:
        """Tokens fed to the model: P + (e - s), one fewer when the targets start at the first generated token."""
        return self.prompt_len + self.num_targets - (self.target_start == 0)

    @property
    def truncated(self) -> bool:
        """True when generated tokens before the targets were cut away."""
        return self.target_start > 0

    def input_positions(self) -> torch.Tensor:
        """Original positions of the tokens fed to the model: int64 ``[num_inputs]``, increasing."""
        p, s, e = self.prompt_len, self.target_start, self.target_end
        generated = torch.arange(p + max(s - 1, 0), p + e - 1)
        return torch.cat([torch.arange(p), generated])

    def target_positions(self) -> torch.Tensor:
        """Original positions of the scored tokens: int64 ``[num_targets]`` = ``P + [s, e)``."""
        return torch.arange(self.prompt_len + self.target_start, self.prompt_len + self.target_end)

    def predictor_index(self) -> torch.Tensor:
        """For each target, the index into ``input_positions()`` of the token before it: int64 ``[num_targets]``."""
        return self.num_inputs - self.num_targets + torch.arange(self.num_targets)

    def loss_mask(self, forced: list[bool] | torch.Tensor | None = None) -> torch.Tensor:
        """bool ``[num_targets]``: True on ``[loss_start, target_end)`` except budget-forced tokens.

        forced: per generated token of the whole trace (``[T]``), or None/empty when nothing was forced.
        """
        mask = torch.arange(self.target_start, self.target_end) >= self.loss_start
        if forced is not None and len(forced):
            forced = torch.as_tensor(forced, dtype=torch.bool)
            if forced.shape != (self.num_generated,):
                raise ValueError(f"forced must have one flag per generated token ({self.num_generated}), "
                                 f"got shape {tuple(forced.shape)}")
            mask &= ~forced[self.target_start:self.target_end]
        return mask


def full_window(prompt_len: int, num_generated: int) -> TrainingWindow:
    """Every generated token a target with a loss."""
    _check_generated(num_generated)
    return TrainingWindow(prompt_len, num_generated, 0, 0, num_generated)


def truncated_window(prompt_len: int, num_generated: int, window: int, multiplier: int = 4) -> TrainingWindow:
    """The last ``min(T, k·W)`` generated tokens as targets, the loss on the last ``W`` (all when T <= k·W).

    prompt_len: P >= 1; num_generated: T >= 1; window: W >= 1; multiplier: k >= 1.
    E.g. P=5, T=100, W=8, k=2: targets 84..99 (positions 89..104), loss on 92..99, inputs at positions
    0..4 and 88..103 (21 tokens).
    """
    _check_generated(num_generated)
    _check_window(window, multiplier)
    kept = min(num_generated, multiplier * window)
    if kept == num_generated:
        return full_window(prompt_len, num_generated)
    start = num_generated - kept
    return TrainingWindow(prompt_len, num_generated, start, num_generated - window, num_generated)


def chunked_windows(prompt_len: int, num_generated: int, window: int, multiplier: int = 4) -> list[TrainingWindow]:
    """Windows that together put a loss on every generated token exactly once, in trace order.

    When T <= k·W this is the single full window. Otherwise the loss chunks are ``[T - W, T)``,
    ``[T - 2W, T - W)``, … down to a first chunk of ``T mod W`` (or W) tokens; each chunk ``[a, b)``
    has targets from ``max(0, a - (k - 1)·W)``. The last window equals ``truncated_window``.
    """
    _check_generated(num_generated)
    _check_window(window, multiplier)
    if num_generated <= multiplier * window:
        return [full_window(prompt_len, num_generated)]
    windows = []
    for end in range(num_generated, 0, -window):
        loss_start = max(end - window, 0)
        start = max(loss_start - (multiplier - 1) * window, 0)
        windows.append(TrainingWindow(prompt_len, num_generated, start, loss_start, end))
    return windows[::-1]


def training_windows(mode: str, prompt_len: int, num_generated: int, window: int | None,
                     multiplier: int = 4) -> list[TrainingWindow]:
    """The windows of one trace for ``mode`` in ``WINDOW_MODES``; ``window=None`` means the whole trace."""
    if mode not in WINDOW_MODES:
        raise ValueError(f"unknown window mode {mode!r}; valid: {', '.join(WINDOW_MODES)}")
    if mode == "full" or window is None:
        return [full_window(prompt_len, num_generated)]
    if mode == "truncated":
        return [truncated_window(prompt_len, num_generated, window, multiplier)]
    return chunked_windows(prompt_len, num_generated, window, multiplier)


def _check_generated(num_generated: int) -> None:
    if num_generated < 1:
        raise ValueError(f"a trace with {num_generated} generated tokens has nothing to train on (need >= 1)")


def _check_window(window: int, multiplier: int) -> None:
    if window < 1:
        raise ValueError(f"window W must be >= 1, got {window}")
    if multiplier < 1:
        raise ValueError(f"multiplier k must be >= 1, got {multiplier}")
