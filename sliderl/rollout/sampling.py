"""Sampling parameters and the batched, counter-based sampler.

``sample`` draws one token per row with the Gumbel-max trick: ``argmax(logits / T + g)`` over the
tokens that survive top-k and top-p, where ``g = -log(-log(u))`` and ``u`` is a pure function of
``(seed, step, vocab index)``. No generator state is involved, so a request draws the same token
whatever else shares its batch, in any row order, and again after preemption and recompute.

The noise hash (all arithmetic on int64 tensors holding unsigned 32-bit values, every product
reduced mod 2**32 without ever exceeding 2**49, so CPU and CUDA compute identical integers):

    mix(x)  = lowbias32: x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
    key_a   = mix(mix(mix(seed_hi ^ 0x2545F491) ^ seed_lo) ^ step_lo)      # per row
    key_b   = mix(key_a ^ 0x9E3779B9)                                      # per row
    h[v]    = mix(mix(v ^ key_a) ^ key_b)                                  # per vocab index v
    u[v]    = (2 * (h[v] >> 9) + 1) / 2**24                                # in (0, 1) strictly

``seed_lo``/``seed_hi`` are the low/high 32 bits of the int64 seed (two's complement), ``step_lo``
the low 32 bits of the step. ``u`` takes 2**23 odd multiples of 2**-24, all exact in float32, so
``u`` is never 0 or 1 and ``g`` is always finite. The float steps (log, add, argmax) may differ by
an ulp between devices, so CPU and CUDA agree on every token except exact near-ties.

Logprob convention (``sample`` and ``logprobs_at`` share it): the log-probability of the token
under the temperature-scaled distribution *before* top-k/top-p truncation,
``log_softmax(logits / T)[token]``; greedy rows (T == 0) use ``log_softmax(logits)[token]``. The
trainer recomputes the same quantity at the same temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from sliderl.core.logprob import logprob_of, scaled_logits

_MASK32 = 0xFFFFFFFF
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops."""

    __pydantic_config__: ClassVar[dict] = {"extra": "forbid", "use_attribute_docstrings": True}

    max_tokens: int = 256
    """Most tokens to generate (>= 1)."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]: keep the smallest top set whose probability reaches top_p; 1 = off."""
    top_k: int = -1
    """Keep only the k most likely tokens (>= 1); -1 = off."""
    seed: int | None = None
    """Per-request seed (int64); None lets the engine derive one from its seed and the request index."""
    stop: str | list[str] | None = None
    """Stop strings; normalised to a list (empty when None)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the request; normalised to a list (empty when None)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    max_thinking_tokens: int | None = None
    """Budget forcing: after this many thinking tokens force ``think_end`` (>= 1); None = no cap."""
    think_end: str = "</think>"
    """Text forced when the thinking budget runs out."""

    def __post_init__(self) -> None:
        _check_int(self.max_tokens, "max_tokens", "an integer >= 1", lambda v: v >= 1)
        _check_number(self.temperature, "temperature", ">= 0 (0 = greedy)", lambda v: v >= 0)
        _check_number(self.top_p, "top_p", "in (0, 1]", lambda v: 0 < v <= 1)
        _check_int(self.top_k, "top_k", "-1 (off) or an integer >= 1", lambda v: v == -1 or v >= 1)
        if self.seed is not None:
            _check_int(self.seed, "seed", f"None or an integer in [{_INT64_MIN}, {_INT64_MAX}]",
                       lambda v: _INT64_MIN <= v <= _INT64_MAX)
        if self.max_thinking_tokens is not None:
            _check_int(self.max_thinking_tokens, "max_thinking_tokens", "None or an integer >= 1", lambda v: v >= 1)
        if not isinstance(self.think_end, str) or not self.think_end:
            raise ValueError(f"think_end must be a non-empty string, got {self.think_end!r}")
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_ids(self.stop_token_ids)

    def for_sample(self, index: int, base_seed: int | None = None) -> SamplingParams:
        """These params for sample ``index`` of a prompt: seed ``base + index``, base being ``base_seed``
        or else this request's own seed; without either the engine derives the seed."""
        base = self.seed if base_seed is None else base_seed
        return self if base is None else replace(self, seed=base + index)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax at every step."""
        return self.temperature == 0


def _check_int(value, name: str, valid: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise ValueError(f"SamplingParams.{name} must be {valid}, got {value!r}")


def _check_number(value, name: str, valid: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or not ok(value):
        raise ValueError(f"SamplingParams.{name} must be {valid}, got {value!r}")


def _normalise_stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"SamplingParams.stop must be a non-empty string or a list of them, got {stop!r}")
    return stops


def _normalise_stop_ids(ids) -> list[int]:
    if ids is None:
        return []
    ids = list(ids)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids (integers >= 0), got {ids!r}")
    return ids


# ---------------------------------------------------------------- counter-based noise


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """In place ``x = x * c mod 2**32`` for x in [0, 2**32): c split in 16-bit halves, no product passes 2**49."""
    hi = torch.mul(x, c >> 16).bitwise_and_(0xFFFF).bitwise_left_shift_(16)  # (x * c_hi mod 2**16) << 16
    return x.mul_(c & 0xFFFF).add_(hi).bitwise_and_(_MASK32)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place lowbias32 finaliser: a bijection on 32-bit values with strong avalanche."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def noise_keys(seed: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row hash keys ``key_a, key_b`` (``[B]`` int64 holding 32-bit values) of the module docstring."""
    seed, step = seed.long(), step.long()
    seed_lo, seed_hi = seed & _MASK32, (seed >> 32) & _MASK32
    key_a = _mix32_(_mix32_(_mix32_(seed_hi ^ 0x2545F491) ^ seed_lo) ^ (step & _MASK32))  # [B]
    return key_a, _mix32_(key_a ^ 0x9E3779B9)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1) that depend only on (seed, step, vocab index): ``[B], [B] -> [B, V]`` float32.

    See the module docstring for the hash. In-place ops keep the [B, V] int64 temporaries to two.
    """
    key_a, key_b = noise_keys(seed, step)
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seed.device)  # [V]
    h = _mix32_(_mix32_(vocab[None, :] ^ key_a[:, None]).bitwise_xor_(key_b[:, None]))  # [B, V]
    return h.bitwise_right_shift_(9).mul_(2).add_(1).to(torch.float32).mul_(2.0**-24)


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` from ``uniform_noise``: ``[B, V]`` float32, always finite."""
    return uniform_noise(seed, step, vocab_size).log_().neg_().log_().neg_()


# ---------------------------------------------------------------- sampler


def _truncation_keep(sorted_scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Which sorted ranks survive top-k then top-p: ``[B, V]`` bool, rank 0 always kept.

    Top-p runs on the top-k distribution renormalised; a rank survives when the probability mass
    strictly before it is below top_p (the smallest prefix whose mass reaches top_p).
    """
    vocab_size = sorted_scaled.shape[1]
    rank = torch.arange(vocab_size, device=sorted_scaled.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), torch.full_like(top_k, vocab_size))
    keep = rank < k[:, None]
    probs = torch.softmax(sorted_scaled.masked_fill(~keep, float("-inf")), dim=-1)  # [B, V]
    mass_before = torch.cumsum(probs, dim=-1).roll(1, dims=-1)
    mass_before[:, 0] = 0.0
    top_p = top_p.to(torch.float32)[:, None]
    return keep & ((mass_before < top_p) | (top_p >= 1.0))


def _check_inputs(logits, temperature, top_p, top_k, seed, step) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    b = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed), ("step", step)):
        if tuple(t.shape) != (b,):
            raise ValueError(f"{name} must have shape [B] = ({b},), got {tuple(t.shape)}")


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           seed: torch.Tensor, step: torch.Tensor, *, all_greedy: bool | None = None,
           any_truncation: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row: ``logits [B, V]`` and per-row ``[B]`` parameters -> ``(tokens, logprobs)``.

    temperature: f32, 0 = greedy (argmax of the raw logits). top_p: f32 in (0, 1], 1 = off.
    top_k: int64, -1 = off. seed: int64. step: int64, the index of the token within its request.
    Order: temperature -> top-k -> top-p -> Gumbel-max over the survivors. Returns int64 tokens
    and float32 logprobs under the module's logprob convention (before truncation).
    ``all_greedy`` / ``any_truncation``: what the caller knows of the rows (every T == 0; some
    top-k or top-p active); given, they spare two device-to-host reads, so nothing here waits for
    the GPU and the engine can queue its next step behind this one. On CUDA, when no row truncates
    and not every row is greedy, one fused Triton pass (``kernels.sample``) does all of it: the same
    tokens and logprobs.
    """
    _check_inputs(logits, temperature, top_p, top_k, seed, step)
    if any_truncation is None:
        any_truncation = bool(((top_k > 0) | (top_p < 1)).any())
    # one fused pass (kernels.sample) when some row samples: 9.6x faster than the torch ops at 256 rows of a
    # 152K vocabulary, 1.6x at one row; all-greedy batches keep argmax + logsumexp, which is faster there
    # (one program per row: ~1 ms whatever the batch; docs/notebook/benchmarks.md)
    if logits.is_cuda and not any_truncation and all_greedy is not True and logits.stride(1) == 1:
        from sliderl.kernels.sample import fused_sample
        return fused_sample(logits, temperature, seed, step)
    return torch_sample(logits, temperature, top_p, top_k, seed, step, all_greedy=all_greedy,
                        any_truncation=any_truncation)


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row greedy: the argmax of the raw logits and its logprob (T == 0 leaves the logits unscaled)."""
    scaled = logits.to(torch.float32)
    tokens = scaled.argmax(dim=-1)
    return tokens, logprob_of(scaled, tokens)


def torch_sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                 seed: torch.Tensor, step: torch.Tensor, *, all_greedy: bool | None = None,
                 any_truncation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` in plain torch ops on any device: the CPU path, rows that truncate, and the reference
    the fused kernel is checked against."""
    greedy = temperature <= 0
    if all_greedy is None:
        all_greedy = bool(greedy.all())
    if all_greedy:
        return greedy_sample(logits)
    scaled = scaled_logits(logits, temperature)  # [B, V]
    noise = gumbel_noise(seed, step, scaled.shape[1])  # [B, V]
    if any_truncation:
        sorted_scaled, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [B, V]
        keep = _truncation_keep(sorted_scaled, top_p, top_k)
        scores = (sorted_scaled + noise.gather(1, order)).masked_fill(~keep, float("-inf"))
        sampled = order.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
    else:
        sampled = (scaled + noise).argmax(dim=-1)
    tokens = torch.where(greedy, scaled.argmax(dim=-1), sampled)
    return tokens, logprob_of(scaled, tokens)
