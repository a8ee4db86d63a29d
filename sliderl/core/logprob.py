"""The sampler's log-probability convention, one definition for the engine's sampler and the trainer.

The log-probability of a token is taken under the temperature-scaled distribution *before* top-k/top-p
truncation, ``log_softmax(logits / T)[token]``; greedy rows (T == 0) use ``log_softmax(logits)[token]``.
The trainer recomputes exactly this quantity at the trace's temperature.
"""

from __future__ import annotations

import torch


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / T`` in float32, with greedy rows (T == 0) left unscaled: ``[B, V]``."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(torch.float32)
    return logits.to(torch.float32) / t[:, None]


def logprob_of(scaled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(scaled)[token]`` per row without materialising the log-softmax: ``[B]``."""
    picked = scaled.gather(1, tokens[:, None]).squeeze(1)
    return picked - torch.logsumexp(scaled, dim=-1)


def logprobs_at(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Logprob of given (e.g. forced) tokens under the sampler's convention: ``[B, V], [B], [B] -> [B]``.

    ``log_softmax(logits / T)[token]``, or ``log_softmax(logits)[token]`` where T == 0.
    """
    return logprob_of(scaled_logits(logits, temperature), tokens.long())
