"""Training windows of a restart trace (``last_k``, ``summary``): one per segment, under exactly its context.

The sampler generated segment s (completion tokens ``[start, end)``) under its own context — the prompt for the
first, the context a restart built for each later one (``core.restart``), encoded afresh at positions ``0 ..``.
So the learner feeds each segment as its own window: the context as the window's "prompt" (inputs, never
targets), the segment's tokens as targets, all at fresh positions, every key visible (death never). The tokens a
restart carried (last_k's kept tokens, the summary inside the template) are context there, not trained again;
each generated token is a target exactly once, in the segment that generated it — the summary call included, as
the model's own output (its forced opening and closing are out of the loss, as every forced token).

Truncated-window training (``window_mode='truncated'`` with a window W): the loss covers the trace's last W
generated tokens, as for any trace, and each segment holding some of them is fed whole as its own window (its
context is the whole of what its tokens saw, at most N + the prompt: nothing to cut). ``chunked`` and ``full``
train every segment whole (each is already at most one context long). W is the learner's ``window``; restart
policies have none of their own, so without it every mode trains the whole trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sliderl.core.kv_policy import NEVER
from sliderl.core.restart import Restart, segments
from sliderl.trainer.logprobs import WindowInput, pack_windows, packed_logprobs
from sliderl.trainer.windows import TrainingWindow


@dataclass(frozen=True)
class SegmentWindow:
    """One segment's window and where its targets sit in the trace: completion indices ``offset + [0, T_s)``."""

    item: WindowInput
    offset: int


def segment_windows(prompt_ids: Sequence[int], completion_ids: Sequence[int], restarts: Sequence[Restart],
                    temperature: float, loss_tail: int | None = None) -> list[SegmentWindow]:
    """The windows of a restart trace (module docstring), in trace order.

    ``loss_tail``: put the loss on the last ``loss_tail`` generated tokens only (truncated training), dropping the
    segments without any; None: on every token. Raises ValueError when the restarts do not fit the trace.
    """
    out, total = [], len(completion_ids)
    first_loss = 0 if loss_tail is None else max(0, total - loss_tail)
    for seg in segments(prompt_ids, total, restarts):
        if seg.end <= first_loss:
            continue
        ids = torch.tensor([*seg.context, *completion_ids[seg.start:seg.end]], dtype=torch.int64)
        n = seg.end - seg.start
        window = TrainingWindow(len(seg.context), n, 0, max(0, first_loss - seg.start), n)
        death = torch.full((ids.shape[0],), NEVER, dtype=torch.int64)
        out.append(SegmentWindow(WindowInput(ids, death, window, temperature), seg.start))
    return out


def restart_logprobs(model, prompt_ids: Sequence[int], completion_ids: Sequence[int], restarts: Sequence[Restart],
                     *, temperature: float = 1.0, backend: str = "auto") -> torch.Tensor:
    """Logprobs of every completion token, each under its segment's context: float32 ``[T]`` (grad when enabled)."""
    windows = segment_windows(prompt_ids, completion_ids, restarts, temperature)
    return packed_logprobs(model, pack_windows([w.item for w in windows]), backend)
