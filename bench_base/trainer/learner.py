"""The Learner: one optimizer step over groups of traces (no Ray; ``cluster/`` wraps it in an actor).

A step: the algorithm selects traces (skipping groups without signal) -> each trace is cut into
training windows (``trainer.masks``) under its own KV policy -> windows are packed into
micro-batches of about ``micro_batch_tokens`` input tokens -> per micro-batch: recompute logprobs
(``trainer.logprobs``), the algorithm's share of the loss, backward -> clip, optimizer step.

Every micro-batch loss is that micro-batch's share of the step's loss (see ``trainer.algorithms``),
so the accumulated gradient is the gradient of one loss over the whole step, whatever the packing.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from rollout.kv_policy import KVPolicy, register_tokens
from rollout.loader import load_model, load_tokenizer
from rollout.trace import Trace
from rollout.vocab import bind_policy_vocab
from trainer.algorithms import Algorithm, Row, Selection, Totals, make_algorithm
from trainer.checkpoint import (TRAINER_STATE, load_trainer_state, rng_state, save_hf_model, save_trainer_state,
                                set_rng_state)
from trainer.logprobs import PackedWindows, WindowInput, logprob_mismatch, pack_windows, packed_logprobs
from trainer.masks import WINDOW_MODES, training_windows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WINDOWED_KINDS = ("prefix_sliding", "sliding_window", "streaming")


@dataclass(frozen=True)
class LearnerConfig:
    """The learner's settings (saved in checkpoints; ``from_checkpoint`` reuses them)."""

    algo: str = "grpo"
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    window_mode: str = "truncated"
    multiplier: int = 4
    micro_batch_tokens: int = 8192
    device: str = "cpu"
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    seed: int = 0
    grpo: dict | None = None
    bonbon: dict | None = None
    kv_policy: str | None = None
    window: int | None = None
    attention: str = "auto"
    reference_model_path: str | None = None

    def check(self) -> None:
        if self.window_mode not in WINDOW_MODES:
            raise ValueError(f"unknown window_mode {self.window_mode!r}; valid: {', '.join(WINDOW_MODES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; valid: {sorted(DTYPES)}")
        for name in ("multiplier", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 or None, got {self.window}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")


@dataclass
class MicroBatch:
    rows: list[Row]
    packed: PackedWindows


class Learner:
    """Trains a ``DecoderLM`` from traces; see the module docstring for one step.

    model_path: a local HF model directory. algo: ``grpo`` | ``bonbon`` | ``sft`` (options in ``grpo``
    / ``bonbon``, see ``trainer.algorithms``). window_mode: ``truncated`` (prompt + last k·W generated
    tokens, loss on the last W), ``chunked`` (every token a loss once; not with bonbon) or ``full``.
    W is the trace policy's window, or ``window`` when given; policies without one (full,
    registers) train on the whole trace. kv_policy: train every trace under this spec instead of
    its own; give ``registers:N`` here so ``<reg_i>`` rows exist before the first step and weight
    sync (a registers trace can also grow the vocabulary lazily, but only before the first step).
    attention: ``auto`` | ``flex`` | ``sdpa`` | ``dense`` (``trainer.attention``).
    reference_model_path: the frozen reference for bonbon and GRPO's KL (default: model_path).
    The optimizer is AdamW over every parameter, in the model's dtype.
    """

    def __init__(self, model_path: str, *, algo: str = "grpo", lr: float = 1e-5, weight_decay: float = 0.0,
                 max_grad_norm: float = 1.0, window_mode: str = "truncated", multiplier: int = 4,
                 micro_batch_tokens: int = 8192, device: str = "cpu", dtype: str = "float32",
                 gradient_checkpointing: bool = False, seed: int = 0, grpo: dict | None = None,
                 bonbon: dict | None = None, kv_policy: str | None = None, window: int | None = None,
                 attention: str = "auto", reference_model_path: str | None = None):
        self.config = LearnerConfig(algo, lr, weight_decay, max_grad_norm, window_mode, multiplier,
                                    micro_batch_tokens, device, dtype, gradient_checkpointing, seed, grpo, bonbon,
                                    kv_policy, window, attention, reference_model_path or str(model_path))
        self.config.check()
        self.algorithm: Algorithm = make_algorithm(algo, grpo, bonbon)
        if self.algorithm.uses_pairs and window_mode == "chunked":
            raise ValueError(f"{algo} needs each trace's whole loss in one window; use window_mode 'truncated' "
                             "or 'full', not 'chunked'")
        torch.manual_seed(seed)
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.model = load_model(model_path, dtype=DTYPES[dtype], device=self.device).train()
        self.model.gradient_checkpointing = gradient_checkpointing
        self.tokenizer = load_tokenizer(model_path)
        self.reference = self._load_reference() if self.algorithm.needs_reference else None
        self.optimizer = self._make_optimizer()
        self.version = 0
        self._policies: dict[str, KVPolicy] = {}
        self.policy = self._bind(kv_policy) if kv_policy else None
        self._bind("full")  # grows the model when the tokenizer already has more tokens, as the engine does

    # ---- set-up -------------------------------------------------------------------------------
    def _load_reference(self):
        reference = load_model(self.config.reference_model_path, dtype=DTYPES[self.config.dtype], device=self.device)
        if len(self.tokenizer) > reference.config.vocab_size:
            reference.resize_vocab(len(self.tokenizer))
        return reference.eval().requires_grad_(False)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.config.lr, weight_decay=self.config.weight_decay)

    def _bind(self, spec: str) -> KVPolicy:
        """The parsed policy bound to the tokenizer's ids; grows the vocabulary (and optimizer) if it must."""
        if spec in self._policies:
            return self._policies[spec]
        policy = KVPolicy.parse(spec)
        vocab = self.tokenizer.get_vocab()
        if policy.kind == "registers" and self.version > 0 and \
                any(t not in vocab for t in register_tokens(policy.num_registers)):
            raise ValueError(f"a {spec} trace needs <reg_i> tokens this learner's vocabulary lacks, and growing it "
                             f"after {self.version} steps would reset the optimizer; build the Learner with "
                             f"kv_policy={spec!r}")
        before = self.model.config.vocab_size
        bound = bind_policy_vocab(policy, self.tokenizer, self.model)
        if self.model.config.vocab_size != before:
            if self.reference is not None:
                self.reference.resize_vocab(self.model.config.vocab_size)
            self.optimizer = self._make_optimizer()
        self._policies[spec] = bound
        return bound

    # ---- one step -----------------------------------------------------------------------------
    def step(self, groups: list[list[Trace]]) -> dict[str, float]:
        """One optimizer step over ``groups`` (each the n traces of one prompt), accumulating over micro-batches.

        Returns float metrics: loss, grad_norm, kl_mismatch (mean k3 of recomputed vs sampler
        logprobs on the loss tokens, see ``trainer.logprobs.Mismatch``), kl_mismatch_k1,
        logprob_diff_max, num_tokens (model inputs), num_loss_tokens, num_traces, num_windows,
        num_micro_batches, skipped_traces_no_loss, the algorithm's counts (zero_variance_groups,
        no_pair_groups, skipped_groups_nonfinite_reward) and loss metrics (clip_frac_low/high,
        ratio_mean, …, token-weighted over micro-batches), step_seconds, version, stepped.
        When no group carries a training signal nothing is stepped (``stepped`` 0, version kept).
        Bad traces (unknown policy, wrong lengths, ids outside the vocabulary, non-finite sampler
        logprobs) raise ValueError; a non-finite loss or gradient raises FloatingPointError.
        """
        start = time.perf_counter()
        for trace in (t for group in groups for t in group):
            self._trace_policy(trace)
            self._check_trace(trace)
        selection = self.algorithm.select(groups)
        units, inputs, skipped = self._units(selection)
        metrics = {**selection.metrics, "skipped_traces_no_loss": float(skipped)}
        self.optimizer.zero_grad(set_to_none=True)
        if not units:
            return self._finish(metrics, start, stepped=False)
        totals = self._totals(units)
        batches = self._micro_batches(units, inputs)
        sums: dict[str, float] = {}
        for batch in batches:
            self._accumulate(batch, totals, sums)
        metrics.update(self._averages(sums, totals))
        metrics.update(num_traces=float(totals.num_traces), num_windows=float(sum(len(u) for u in units)),
                       num_micro_batches=float(len(batches)))
        metrics["grad_norm"] = self._clip_and_step()
        return self._finish(metrics, start, stepped=True)

    def _units(self, selection: Selection) -> tuple[list[list[Row]], dict[int, WindowInput], int]:
        """Rows that must share a micro-batch (a BoNBoN pair; else one window), each row's packable input
        (keyed by ``id(row)``), and how many traces had no loss token (their unit is dropped: a pair needs both)."""
        per_trace = [self._trace_rows(i, trace, selection) for i, trace in enumerate(selection.traces)]
        units, skipped = [], 0
        for unit in selection.units:
            if not all(per_trace[i] for i in unit):
                skipped += sum(1 for i in unit if not per_trace[i])
            elif self.algorithm.uses_pairs:
                units.append([row for i in unit for row, _ in per_trace[i]])
            else:  # token-linear losses: every window may go to its own micro-batch
                units += [[row] for i in unit for row, _ in per_trace[i]]
        inputs = {id(row): item for pairs in per_trace for row, item in pairs}
        return units, inputs, skipped

    def _trace_rows(self, index: int, trace: Trace, selection: Selection) -> list[tuple[Row, WindowInput]]:
        policy = self._trace_policy(trace)
        prompt_len, num_generated = len(trace.prompt_token_ids), len(trace.completion_token_ids)
        if num_generated == 0:
            return []
        window = self.config.window or (policy.window if policy.kind in WINDOWED_KINDS else None)
        windows = training_windows(self.config.window_mode, prompt_len, num_generated, window, self.config.multiplier)
        ids = torch.tensor([*trace.prompt_token_ids, *trace.completion_token_ids], dtype=torch.int64)
        death = policy.death_positions(prompt_len, ids)
        sampler = torch.tensor(trace.logprobs, dtype=torch.float32)
        out = []
        for w in windows:
            mask = w.loss_mask(trace.forced)
            if mask.any():
                row = Row(index, selection.advantages[index], selection.roles[index], mask,
                          sampler[w.target_start:w.target_end])
                out.append((row, WindowInput(ids, death, w, trace.temperature)))
        return out

    def _trace_policy(self, trace: Trace) -> KVPolicy:
        if self.policy is not None:
            return self.policy
        try:
            return self._bind(trace.kv_policy)
        except ValueError as err:
            raise ValueError(f"trace {trace.trace_id!r}: {err}") from None

    def _check_trace(self, trace: Trace) -> None:
        name, n = f"trace {trace.trace_id!r}", len(trace.completion_token_ids)
        if not trace.prompt_token_ids:
            raise ValueError(f"{name} has an empty prompt; a trace needs at least one prompt token")
        if len(trace.logprobs) != n:
            raise ValueError(f"{name} has {len(trace.logprobs)} sampler logprobs for {n} completion tokens")
        if trace.forced and len(trace.forced) != n:
            raise ValueError(f"{name} has {len(trace.forced)} forced flags for {n} completion tokens")
        if not all(math.isfinite(x) for x in trace.logprobs):
            raise ValueError(f"{name} has non-finite sampler logprobs")
        vocab = self.model.config.vocab_size
        bad = [t for t in (*trace.prompt_token_ids, *trace.completion_token_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, {vocab})")
        if not (trace.temperature >= 0 and math.isfinite(trace.temperature)):
            raise ValueError(f"{name} has temperature {trace.temperature}; it must be a finite number >= 0")

    def _totals(self, units: list[list[Row]]) -> Totals:
        per_trace: dict[int, int] = {}
        for row in (r for u in units for r in u):
            per_trace[row.trace_index] = per_trace.get(row.trace_index, 0) + int(row.loss_mask.sum())
        return Totals(sum(per_trace.values()), len(per_trace), len(units), per_trace)

    def _micro_batches(self, units: list[list[Row]], inputs: dict[int, WindowInput]) -> list[MicroBatch]:
        """Greedy packing in order; a unit never splits, and one larger than the budget goes alone."""
        batches, current, size = [], [], 0
        for unit in units:
            tokens = sum(inputs[id(r)].window.num_inputs for r in unit)
            if current and size + tokens > self.config.micro_batch_tokens:
                batches.append(current)
                current, size = [], 0
            current += unit
            size += tokens
        batches.append(current)
        return [MicroBatch(rows, pack_windows([inputs[id(r)] for r in rows])) for rows in batches]

    def _accumulate(self, batch: MicroBatch, totals: Totals, sums: dict[str, float]) -> None:
        """Forward, loss share, backward for one micro-batch; adds token-weighted metrics to ``sums``."""
        backend = self.config.attention
        for row, lp in zip(batch.rows, batch.packed.split(packed_logprobs(self.model, batch.packed, backend))):
            row.logprobs = lp
        if self.reference is not None:
            with torch.no_grad():
                ref = packed_logprobs(self.reference, batch.packed, backend)
            for row, lp in zip(batch.rows, batch.packed.split(ref)):
                row.ref_logprobs = lp
        for row in batch.rows:
            row.behaviour = row.behaviour.to(self.device)
            row.loss_mask = row.loss_mask.to(self.device)
        out = self.algorithm.loss(batch.rows, totals)
        if not torch.isfinite(out.loss):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite loss {out.loss.item()} in a micro-batch of {len(batch.rows)} "
                                     f"windows (traces {sorted({r.trace_index for r in batch.rows})})")
        out.loss.backward()
        self._add_metrics(batch, out.metrics, sums)

    def _add_metrics(self, batch: MicroBatch, loss_metrics: dict[str, float], sums: dict[str, float]) -> None:
        mask = torch.cat([r.loss_mask for r in batch.rows])
        recomputed = torch.cat([r.logprobs.detach() for r in batch.rows])
        behaviour = torch.cat([r.behaviour for r in batch.rows])
        mismatch = logprob_mismatch(behaviour, recomputed, mask)
        n = mismatch.num_tokens
        add = lambda key, value: sums.__setitem__(key, sums.get(key, 0.0) + value)  # noqa: E731
        add("loss", loss_metrics.get("loss", 0.0))
        add("num_tokens", float(batch.packed.num_tokens))
        add("kl_mismatch", mismatch.kl * n)
        add("kl_mismatch_k1", mismatch.kl_k1 * n)
        sums["logprob_diff_max"] = max(sums.get("logprob_diff_max", 0.0), mismatch.max_abs)
        for key, value in loss_metrics.items():
            if key not in ("loss", "num_loss_tokens"):
                add(f"_weighted/{key}", value * n)

    def _averages(self, sums: dict[str, float], totals: Totals) -> dict[str, float]:
        n = totals.num_loss_tokens
        out = {"num_loss_tokens": float(n), "loss": sums["loss"], "num_tokens": sums["num_tokens"],
               "logprob_diff_max": sums["logprob_diff_max"]}
        for key in ("kl_mismatch", "kl_mismatch_k1"):
            out[key] = sums[key] / n
        out.update({k.split("/", 1)[1]: v / n for k, v in sums.items() if k.startswith("_weighted/")})
        return out

    def _clip_and_step(self) -> float:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {grad_norm}; the step was not taken")
        self.optimizer.step()
        self.version += 1
        return grad_norm

    def _finish(self, metrics: dict[str, float], start: float, stepped: bool) -> dict[str, float]:
        metrics.update(stepped=float(stepped), version=float(self.version), step_seconds=time.perf_counter() - start)
        if not stepped:
            metrics.update(loss=0.0, grad_norm=0.0, num_loss_tokens=0.0, num_tokens=0.0, num_traces=0.0)
        return metrics

    # ---- weights and checkpoints ----------------------------------------------------------------
    def state_dict(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """HF-named weights copied to ``device`` (tied ``lm_head.weight`` omitted: ``DecoderLM.load_weights``
        skips it anyway)."""
        return {name: p.detach().to(device, copy=True) for name, p in self.model.named_parameters()}

    def save_checkpoint(self, path) -> None:
        """The model in HF layout in ``path`` plus ``trainer_state.pt`` (optimizer, version, RNG, settings)."""
        save_hf_model(self.model, self.tokenizer, self.model_path, path)
        save_trainer_state(path, {"version": self.version, "optimizer": self.optimizer.state_dict(),
                                  "rng": rng_state(), "config": asdict(self.config)})

    @classmethod
    def from_checkpoint(cls, path, **kwargs) -> Learner:
        """Resume from ``save_checkpoint(path)``: weights, optimizer, version, RNG; ``kwargs`` override settings."""
        state = load_trainer_state(path)
        settings = {**state["config"], **kwargs}
        learner = cls(str(path), **settings)
        learner.optimizer.load_state_dict(state["optimizer"])
        learner.version = int(state["version"])
        set_rng_state(state["rng"])
        return learner


__all__ = ["Learner", "LearnerConfig", "TRAINER_STATE"]
