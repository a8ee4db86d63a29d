"""Recompute the sampler's per-token logprobs in the trainer, under the trace's own visibility.

The trainer runs the engine's model teacher-forced over packed training windows (``trainer.windows``)
with the attention of ``trainer.attention`` and scores each target with ``rollout.sampling``'s
convention — ``log_softmax(logits / T)[token]``, ``T = 1`` for greedy traces (``temperature == 0``)
— by calling the sampler's own ``logprobs_at``. Over a whole trace the result equals the sampler's
logprobs up to float error; over a truncated window it differs by the cut context, which
``logprob_mismatch`` reports.

A ``pasta`` trace (``core.pasta.PastaLayout``) is scored whole, under its threads' visibility and
position ids, each token predicted by the previous token of its own thread (a promise's ``/>``
predicts the first main-thread token after its block), as the runtime samples it. Inputs stay in
flattened order; only the predictor of each target, the mask and the position ids change. A fork's
``<async>`` keeps a target slot, so per-target tensors line up with the completion as for any
trace, but it is never in the loss (the runtime inserts it).

A ``planned_diffusion`` trace (``core.planned_diffusion``) is scored whole with one noise draw
(``NoisedLayout``): the clean response, then a noised copy of its spans (``diffusion_stream``). Its targets are
the completion's (each autoregressive token predicted by the previous one; span tokens keep a slot, never in the
loss) followed by every span body token of the copies, predicted at its own position (``WindowInput.target_kind``
says which is which: autoregressive, a body token kept, a masked one).

Shape letters: N packed input tokens, M packed targets, D windows in a pack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sliderl.core.kv_policy import KVPolicy
from sliderl.core.logprob import logprobs_at
from sliderl.core.model import DecoderLM, elementwise
from sliderl.core.pasta import PastaLayout
from sliderl.core.planned_diffusion import NoisedLayout
from sliderl.core.trace import Trace
from sliderl.trainer.attention import PackedVisibility, training_attention
from sliderl.trainer.windows import TrainingWindow, full_window


@dataclass(frozen=True)
class WindowInput:
    """One window of one trace: the whole trace's ids and deaths, the window, the sampler temperature, and
    for a ``pasta`` trace its layout, for a ``planned_diffusion`` trace its layout with a noise draw (then the
    window must be the whole trace)."""

    token_ids: Tensor  # [P + T] int64, prompt then completion
    death: Tensor  # [P + T] int64, KVPolicy.death_positions over the whole trace
    window: TrainingWindow
    temperature: float
    layout: PastaLayout | NoisedLayout | None = None  # the whole trace's threads / spans, positions and targets

    def __post_init__(self) -> None:
        w = self.window
        n = w.prompt_len + w.num_generated
        if self.token_ids.shape != (n,) or self.death.shape != (n,):
            raise ValueError(f"window is for {n} trace tokens, got token_ids {tuple(self.token_ids.shape)} "
                             f"and death {tuple(self.death.shape)}")
        if self.layout is None:
            return
        if (len(self.layout), self.layout.prompt_len) != (n, w.prompt_len):
            raise ValueError(f"the layout is for {self.layout.prompt_len} prompt + {len(self.layout) - w.prompt_len} "
                             f"generated tokens, the window for {w.prompt_len} + {w.num_generated}")
        if (w.target_start, w.loss_start, w.target_end) != (0, 0, w.num_generated):
            kind = "pasta" if isinstance(self.layout, PastaLayout) else "planned_diffusion"
            raise ValueError(f"a {kind} trace trains on the whole trace only (window_mode='full'; its forks' or spans' "
                             f"keys and position ids span it), got targets [{w.target_start}, {w.target_end}) with "
                             f"loss from {w.loss_start} of {w.num_generated} generated tokens")

    @property
    def num_inputs(self) -> int:
        """Tokens fed to the model (a planned_diffusion trace's noised spans included)."""
        extra = self.layout.num_copied if isinstance(self.layout, NoisedLayout) else 0
        return self.window.num_inputs + extra

    @property
    def num_targets(self) -> int:
        """Tokens scored (a planned_diffusion trace's span bodies once more, as diffusion targets)."""
        extra = self.layout.num_body if isinstance(self.layout, NoisedLayout) else 0
        return self.window.num_targets + extra

    def loss_mask(self, forced: list[bool] | Tensor | None = None) -> Tensor:
        """bool ``[num_targets]``: the window's loss mask (``TrainingWindow.loss_mask``); for a pasta trace not on a
        fork's ``<async>``; for a planned_diffusion trace on its autoregressive tokens, then on every body token of
        the noised spans (masked or kept: all count in the loss's normaliser, ``target_kind`` weights them)."""
        mask = self.window.loss_mask(forced)
        if isinstance(self.layout, NoisedLayout):
            body = torch.ones(self.layout.num_body, dtype=torch.bool)
            return torch.cat([mask & self.layout.layout.ar_target_mask(), body])
        return mask if self.layout is None else mask & self.layout.target_mask()

    def target_kind(self) -> Tensor | None:
        """int8 ``[num_targets]`` for a planned_diffusion trace (``core.planned_diffusion``: 0 autoregressive,
        1 a span body token kept, 2 one masked); None otherwise."""
        if not isinstance(self.layout, NoisedLayout):
            return None
        return self.layout.stream(self.token_ids).target_kind


@dataclass(frozen=True)
class PackedWindows:
    """D windows as one flat stream: model inputs ``[N]`` and the targets they score ``[M]``."""

    input_ids: Tensor  # [N] int64
    positions: Tensor  # [N] int64, position ids (the original positions; a pasta layout's)
    visibility: PackedVisibility  # [N] positions, deaths, documents
    predictor_index: Tensor  # [M] int64, flat input index whose logits score each target
    target_ids: Tensor  # [M] int64
    temperature: Tensor  # [M] float32, the sampler's temperature of each target's trace
    offsets: tuple[int, ...]  # D + 1 cumulative target counts: window d owns targets offsets[d]:offsets[d+1]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def split(self, values: Tensor) -> list[Tensor]:
        """``[M, ...]`` -> D tensors, one per window, in pack order."""
        return [values[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def to(self, device: torch.device | str) -> PackedWindows:
        return PackedWindows(self.input_ids.to(device), self.positions.to(device), self.visibility.to(device),
                             self.predictor_index.to(device), self.target_ids.to(device),
                             self.temperature.to(device), self.offsets)


def pack_windows(windows: Sequence[WindowInput]) -> PackedWindows:
    """Concatenate windows into one stream; each window's tokens sit at their original positions."""
    if not windows:
        raise ValueError("pack_windows needs at least one window")
    ids, positions, parts, predictors, targets, temps, offsets = [], [], [], [], [], [], [0]
    base = 0
    for item in windows:
        w, layout = item.window, item.layout
        order = w.input_positions()  # [n] indices into the trace
        if isinstance(layout, NoisedLayout):  # the whole trace and its noised spans (core.planned_diffusion)
            stream = layout.stream(item.token_ids)
            ids.append(stream.input_ids)
            positions.append(stream.positions)
            parts.append((stream.write_at, item.death[stream.positions], stream.span, stream.exposed_at,
                          stream.view_at))
            predictors.append(base + stream.predictor_index)
            targets.append(stream.target_ids)
        elif layout is None:
            ids.append(item.token_ids[order])
            positions.append(order)
            parts.append((order, item.death[order]))
            predictors.append(base + w.predictor_index())
            targets.append(item.token_ids[w.target_positions()])
        else:  # the whole trace: input index = trace index
            ids.append(item.token_ids[order])
            positions.append(layout.positions[order])
            parts.append((order, item.death[order], layout.thread[order], layout.exposed_at()[order],
                          layout.view_at()[order]))
            predictors.append(base + layout.predictor_index())
            targets.append(item.token_ids[w.target_positions()])
        temps.append(torch.full((item.num_targets,), float(item.temperature)))
        offsets.append(offsets[-1] + item.num_targets)
        base += ids[-1].shape[0]
    return PackedWindows(torch.cat(ids).long(), torch.cat(positions), PackedVisibility.pack(parts),
                         torch.cat(predictors), torch.cat(targets).long(), torch.cat(temps), tuple(offsets))


def packed_logits(model: DecoderLM, packed: PackedWindows, backend: str = "auto",
                  device: torch.device | None = None) -> Tensor:
    """The logits that score every target: float32 ``[M, V]``, with grad when enabled. ``device``: where the
    model computes (default: where its parameters are; a CPU-offloaded sharded model computes on the GPU)."""
    device = device or next(model.parameters()).device
    packed = packed.to(device)
    attn = training_attention(packed.visibility, device, backend)
    hidden = model(packed.input_ids, packed.positions, attn)  # [N, hidden]
    return model.compute_logits(hidden[packed.predictor_index])  # [M, V] float32


LOGIT_CHUNK_ELEMENTS = 2**27  # float32 logits materialised at once by packed_logprobs: 512 MiB


def packed_logprobs(model: DecoderLM, packed: PackedWindows, backend: str = "auto",
                    chunk_rows: int | None = None, device: torch.device | None = None) -> Tensor:
    """Logprob of every target under the sampler's convention: float32 ``[M]``, with grad when enabled.

    The ``[M, V]`` float32 logits are never held whole: targets go through the LM head in chunks of
    ``chunk_rows`` (default: ``LOGIT_CHUNK_ELEMENTS // V``, about 880 rows of a 152K vocabulary), each
    under activation checkpointing when grad is on, so backward recomputes one chunk's logits at a
    time. Memory for the loss is then flat in the number of targets instead of M x V x 4 bytes
    (13.9 GiB at M = 23K of a 152K vocabulary). With the model's ``compile_elementwise`` (training) each chunk's
    head — GEMM, float32 cast, temperature, log-sum-exp and the target's logit — is one ``torch.compile``d
    graph, whose float32 passes over ``[C, V]`` the compiler fuses (forward and backward).
    """
    device = device or next(model.parameters()).device  # as packed_logits
    packed = packed.to(device)
    attn = training_attention(packed.visibility, device, backend)
    hidden = model(packed.input_ids, packed.positions, attn)[packed.predictor_index]  # [M, hidden]
    rows = chunk_rows or max(1, LOGIT_CHUNK_ELEMENTS // model.config.vocab_size)
    if model.compile_elementwise and torch.is_grad_enabled():
        head = elementwise(head_logprobs, True)
        chunk_fn = lambda h, t, temp: head(h, model.lm_head.weight, t, temp)  # noqa: E731
    else:
        chunk_fn = lambda h, t, temp: _chunk_logprobs(model, h, t, temp)  # noqa: E731
    if hidden.shape[0] <= rows:
        return chunk_fn(hidden, packed.target_ids, packed.temperature)
    chunks = zip(hidden.split(rows), packed.target_ids.split(rows), packed.temperature.split(rows))
    if not torch.is_grad_enabled():
        return torch.cat([chunk_fn(*chunk) for chunk in chunks])
    from torch.utils.checkpoint import checkpoint
    return torch.cat([checkpoint(chunk_fn, *chunk, use_reentrant=False) for chunk in chunks])


def head_logprobs(hidden: Tensor, weight: Tensor, target_ids: Tensor, temperature: Tensor) -> Tensor:
    """The LM head and the sampler's logprob in one function (what ``compile_elementwise`` compiles): ``hidden
    [C, hidden]``, ``weight [V, hidden]`` -> float32 ``[C]``; the math of ``_chunk_logprobs`` in training."""
    return logprobs_at(torch.nn.functional.linear(hidden, weight).float(), target_ids, temperature)


def _chunk_logprobs(model: DecoderLM, hidden: Tensor, target_ids: Tensor, temperature: Tensor) -> Tensor:
    """``[C, hidden]`` -> the logprobs of ``target_ids [C]`` at ``temperature [C]``: float32 ``[C]``."""
    return logprobs_at(model.compute_logits(hidden), target_ids, temperature)


def recompute_logprobs(model: DecoderLM, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                       policy: KVPolicy, *, temperature: float = 1.0, window: TrainingWindow | None = None,
                       backend: str = "auto", kv_deaths: Sequence[tuple[int, int, int]] = (),
                       layout: PastaLayout | NoisedLayout | None = None) -> Tensor:
    """Logprobs of ``window``'s targets (default: every completion token) under ``policy``: float32 ``[num_targets]``.

    policy: parsed and, for ``registers``, bound to the token ids (``core.vocab.bind_policy_vocab``).
    temperature: the sampler's (0 = greedy, scored at T = 1). kv_deaths: the engine's recorded
    ``(start, end, death)`` ranges (h2o). layout: a pasta trace's (required for pasta), a planned_diffusion trace's
    with its noise (``NoisedLayout``, required for planned_diffusion: the result then has the span bodies' diffusion
    targets after the completion's). Runs without grad only if the caller disables it.
    """
    item = window_input(prompt_ids, completion_ids, policy, temperature, window, kv_deaths, layout)
    return packed_logprobs(model, pack_windows([item]), backend)


def trace_logprobs(model: DecoderLM, trace: Trace, policy: KVPolicy | None = None, *,
                   window: TrainingWindow | None = None, backend: str = "auto",
                   layout: PastaLayout | None = None) -> Tensor:
    """``recompute_logprobs`` for a Trace, at its temperature; policy defaults to ``trace.kv_policy``."""
    policy = KVPolicy.parse(trace.kv_policy) if policy is None else policy
    return recompute_logprobs(model, trace.prompt_token_ids, trace.completion_token_ids, policy,
                              temperature=trace.temperature, window=window, backend=backend,
                              kv_deaths=trace.death_ranges, layout=layout)


def window_input(prompt_ids: Sequence[int], completion_ids: Sequence[int], policy: KVPolicy, temperature: float,
                 window: TrainingWindow | None = None, kv_deaths: Sequence[tuple[int, int, int]] = (),
                 layout: PastaLayout | NoisedLayout | None = None) -> WindowInput:
    """A ``WindowInput`` with deaths computed over the whole trace (the policy's, then the recorded
    ``kv_deaths`` ranges on top); checks the window fits the trace. ``layout``: given exactly for a
    ``pasta`` policy (``PastaLayout.parse`` of the trace) and a ``planned_diffusion`` one (a ``NoisedLayout``). A
    restart policy's trace is scored segment by segment (``trainer.restarts``), not here."""
    if policy.restarts:
        raise ValueError(f"a {policy.spec} trace is scored segment by segment, each under its own context: use "
                         "sliderl.trainer.restarts.restart_logprobs (or segment_windows) with the trace's restarts")
    needs = {"pasta": PastaLayout, "planned_diffusion": NoisedLayout}.get(policy.kind)
    if needs is None and layout is not None or needs is not None and not isinstance(layout, needs):
        name = needs.__name__ if needs is not None else "no layout"
        raise ValueError(f"policy {policy.spec!r} takes {name}, got layout "
                         f"{type(layout).__name__ if layout is not None else 'None'}; a PastaLayout is required for "
                         "the pasta policy and only for it (sliderl.core.pasta.PastaLayout.parse(prompt_len, "
                         "completion_ids, tags, tokenizer.decode)), a NoisedLayout for planned_diffusion")
    ids = torch.tensor([*prompt_ids, *completion_ids], dtype=torch.int64)
    window = window or full_window(len(prompt_ids), len(completion_ids))
    if (window.prompt_len, window.num_generated) != (len(prompt_ids), len(completion_ids)):
        raise ValueError(f"window is for a trace of {window.prompt_len} prompt + {window.num_generated} generated "
                         f"tokens, got {len(prompt_ids)} + {len(completion_ids)}")
    death = policy.death_positions(len(prompt_ids), ids, kv_deaths)
    return WindowInput(ids, death, window, temperature, layout)


# ---------------------------------------------------------------- sampler/trainer mismatch


@dataclass(frozen=True)
class Mismatch:
    """Sampler vs trainer logprobs over the loss tokens.

    kl: mean k3 estimate ``exp(x) - x - 1`` with ``x = recomputed - behaviour`` — unbiased for
        KL(sampler || trainer) on tokens drawn from the sampler, and >= 0 token by token (the same
        estimator as ``grpo_loss``'s ``mismatch_kl``).
    kl_k1: mean ``behaviour - recomputed`` (the plain estimator of the same KL; can be negative).
    max_abs: largest ``|behaviour - recomputed|``.
    """

    kl: float
    kl_k1: float
    max_abs: float
    num_tokens: int


def logprob_mismatch(behaviour: Tensor, recomputed: Tensor, mask: Tensor) -> Mismatch:
    """behaviour, recomputed: ``[M]`` logprobs; mask: ``[M]`` bool loss tokens (at least one)."""
    if behaviour.shape != recomputed.shape or mask.shape != recomputed.shape:
        raise ValueError(f"behaviour {tuple(behaviour.shape)}, recomputed {tuple(recomputed.shape)} and mask "
                         f"{tuple(mask.shape)} must have one shape")
    mask = mask.bool().to(recomputed.device)
    n = int(mask.sum())
    if n == 0:
        raise ValueError("the loss mask selects no tokens; the mismatch needs at least one loss token")
    x = (recomputed.detach().double() - behaviour.to(recomputed.device).double())[mask]  # [n]
    if not torch.isfinite(x).all():
        raise ValueError("behaviour or recomputed logprobs are not finite on the loss tokens")
    k3 = torch.exp(x) - x - 1.0
    return Mismatch(float(k3.mean()), float(-x.mean()), float(x.abs().max()), n)
