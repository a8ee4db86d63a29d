"""The engine's seam for decoding modes: how a request becomes sequences and how sampled tokens change them.

The engine's step (schedule -> run -> sample -> postprocess) names no mode. A mode plugs in at four fixed
points and owns its own state:

- **admit** — ``new_request`` turns a request into the ``Sequence`` that stands for it (a mode may return its
  own subclass: Pasta's main thread), ``block_bound`` says the most blocks such a request holds;
- **schedule** — the scheduler asks each sequence its own questions (``Sequence.threads``, ``ready_tokens``,
  ``table_positions``, ``rope_positions``, ``fit``, ``take_dead_slots``, ...), so a mode's sequences decide
  what they compute; a mode adds sequences to a running request with ``Scheduler.add_thread``;
- **after sampling** — ``take`` receives each sampled (or forced) token of a sequence;
- **finish** — ``end_step`` says which requests finished after the step, ``output`` builds the record of one.
  ``end_step`` is also where a mode runs forwards of its own (``EngineContext.runner``) before the next step is
  scheduled: Planned Diffusion denoises its requests' spans there, whose rows need logits at every position and
  attention in both directions within a span, which the engine's step (one sampled token per row, causal
  kernels) does not compute.

``DecodingMode`` itself is plain decoding: one sequence per request that appends what it samples (budget
forcing, register kills and stops included, through the ``Postprocessor``). Modes are chosen by KV policy
kind in ``rollout.modes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from sliderl.core.kv_policy import KVPolicy
from sliderl.rollout.block_bound import block_bound
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.scheduler import ScheduledBatch, Scheduler
from sliderl.rollout.sequence import RequestOutput, Sequence


class TokenSteps(Protocol):
    """What a mode may ask of the engine's ``Postprocessor`` for one sequence."""

    def append(self, seq: Sequence, token: int, logprob: float, logits: torch.Tensor) -> None:
        """Record the token, or the one budget forcing puts in its place; apply a register kill it causes."""

    def stops(self, seq: Sequence) -> bool:
        """Whether its last token ends it (eos, a stop token or string, its length); sets its finish reason."""

    def finish(self, seq: Sequence) -> None:
        """Its request is done: it leaves the scheduler."""

    def text(self, seq: Sequence, out: list[int], cut: bool = True) -> str:
        """``out`` decoded as the request's text (without a final eos, cut at a stop string unless not ``cut``)."""


@dataclass(frozen=True)
class EngineContext:
    """What a mode may use of its engine: the scheduler (and through it the block pool), the bound policy,
    the tokenizer, the tokens that end a request, and the engine's sizes; and its ``ModelRunner`` (the model and
    the KV pool) for a mode that runs forwards of its own between steps (Planned Diffusion's denoising)."""

    scheduler: Scheduler
    policy: KVPolicy
    tokenizer: object
    eos_ids: frozenset[int]
    block_size: int
    max_model_len: int
    max_chunk: int  # the longest prefill chunk (max_num_batched_tokens)
    runner: object = None  # the engine's ModelRunner: .model, .cache (reallocated by wake), .device, .scale


class DecodingMode:
    """Plain decoding; the base of every mode (module docstring). ``args`` is the engine's ``EngineArgs``."""

    name: ClassVar[str] = "plain"

    def __init__(self, context: EngineContext, args):
        self.context = context
        self.args = args

    # ---- admit ------------------------------------------------------------------------------------
    def new_request(self, request_id: int, prompt: list[int], params: SamplingParams, seed: int,
                    arrival: float) -> Sequence:
        """The sequence that stands for a new request."""
        c = self.context
        return Sequence(request_id, prompt, params, seed, c.policy.tracker(len(prompt)), c.block_size, arrival,
                        max_model_len=c.max_model_len, max_chunk=c.max_chunk)

    def block_bound(self, prompt_len: int, max_tokens: int) -> int:
        """The most blocks a request of ``prompt_len`` prompt tokens and ``max_tokens`` generated ones holds."""
        c = self.context
        return block_bound(c.policy, prompt_len, max_tokens, c.max_model_len, c.block_size, c.max_chunk)

    def smaller_request(self) -> str:
        """What a user may lower when one request's block bound exceeds the pool."""
        policy = self.context.policy
        if policy.bounded:
            return "max_tokens, the window or the prompt"
        return "the budget, max_tokens or the prompt" if policy.kind == "h2o" else "max_tokens or the prompt"

    def check_thread(self, thread: int) -> None:
        """Raise ValueError unless ``thread`` names a thread of a request (``LLM.force``): 0 only here."""
        if isinstance(thread, bool) or not isinstance(thread, int) or thread != 0:
            raise ValueError(f"thread must be 0 (forks exist under kv=pasta only), got {thread!r}")

    # ---- after sampling ---------------------------------------------------------------------------
    def take(self, post: TokenSteps, seq: Sequence, token: int, logprob: float, logits: torch.Tensor) -> bool:
        """``seq`` sampled ``token`` (``logits``: its row); True when that finished its request."""
        post.append(seq, token, logprob, logits)
        if post.stops(seq):
            post.finish(seq)
            return True
        return False

    # ---- finish -----------------------------------------------------------------------------------
    def end_step(self, batch: ScheduledBatch, finished: list[Sequence]) -> list[Sequence]:
        """The requests that finished in the step that computed ``batch`` (``finished``: those ``take`` said)."""
        return finished

    def output(self, post: TokenSteps, seq: Sequence) -> RequestOutput:
        """The record of a finished request: text decoded without a final eos, cut at a stop string."""
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, seq.logprobs,
                             post.text(seq, seq.output_token_ids), seq.finish_reason, seq.kv, seq.forced,
                             seq.num_preemptions, seq.finished_at - seq.arrival, list(seq.kv_deaths),
                             [t - seq.arrival for t in seq.token_times])
