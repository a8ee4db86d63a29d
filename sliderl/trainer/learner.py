"""The Learner: one optimizer step over groups of traces (no Ray; ``cluster/`` wraps it in an actor).

A step: the algorithm selects traces (skipping groups without signal) -> each trace is cut into
training windows (``trainer.windows``) under its own KV policy -> windows are packed into
micro-batches of about ``micro_batch_tokens`` input tokens -> per micro-batch: recompute logprobs
(``trainer.logprobs``), the algorithm's share of the loss, backward -> clip, optimizer step.

Every micro-batch loss is that micro-batch's share of the step's loss (see ``trainer.algorithms``),
so the accumulated gradient is the gradient of one loss over the whole step, whatever the packing.

The same class trains at one rank and at N (``trainer.parallel``): every rank selects over all of the
step's groups (so the totals that normalise the loss are global), takes its own units of the token-balanced
split, and runs as many micro-batches as the busiest rank (padding with zero-weight ones); FSDP2 sums the
gradients over ranks and clipping uses their global norm.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from sliderl.core.kv_policy import KVPolicy, register_tokens
from sliderl.core.loader import DTYPES, load_model, load_tokenizer
from sliderl.core.trace import Trace
from sliderl.core.vocab import bind_policy_vocab, policy_tokens
from sliderl.trainer.algorithms import Algorithm, Row, Selection, Totals, make_algorithm
from sliderl.trainer.checkpoint import (
    TRAINER_STATE,
    load_trainer_state,
    read_hf_source,
    rng_state,
    save_hf_model,
    save_trainer_state,
    set_rng_state,
)
from sliderl.trainer.learner_args import LearnerArgs, compiles_elementwise
from sliderl.trainer.logprobs import (
    PackedWindows,
    WindowInput,
    logprob_mismatch,
    pack_windows,
    packed_logits,
    packed_logprobs,
    window_input,
)
from sliderl.trainer.manifest import Manifest, check_intact
from sliderl.trainer.metrics import Evaluation, StepMetrics
from sliderl.trainer.optimizer import make_optimizer
from sliderl.trainer.parallel import Parallel, available_host_memory, check_host_memory, host_state_bytes
from sliderl.trainer.trace_rows import TraceWindows, check_trace


@dataclass
class MicroBatch:
    rows: list[Row]
    packed: PackedWindows


class Learner:
    """Trains a ``DecoderLM`` from traces; see the module docstring for one step.

    ``Learner(model_path, args)`` with a ``LearnerArgs``, or ``Learner(model_path, lr=..., ...)``
    whose keywords build (or, beside ``args``, replace fields of) the record. model_path: a local HF
    model directory. Each trace trains under its own ``kv_policy``; W is that policy's window, or
    ``args.window`` when given; policies without one (full, registers) train on the whole trace.
    A ``pasta`` trace trains whole under its threads (``core.pasta.PastaLayout``: mask, position
    ids, each token predicted within its thread) and needs ``window_mode='full'``; so does a
    ``planned_diffusion`` trace, under its spans with one noise draw per step (``core.planned_diffusion``;
    ``evaluate`` masks every body token), trained by the planned_diffusion algorithm only. A restart trace
    (``last_k``, ``summary``) trains segment by segment, each under the context it was sampled in
    (``trainer.restarts``).
    ``args.vocab_policy`` (e.g. ``registers:N``) adds that policy's tokens before the first step and
    weight sync (a registers trace can also grow the vocabulary lazily, but only before step 1).
    The optimizer is AdamW over every parameter at ``args.lr_at(version)``, in the model's dtype or, with
    ``args.master_weights``, over float32 master copies (``trainer.optimizer``; sharded: FSDP2's float32
    sharded parameters). ``parallel``: this rank of a sharded learner (``trainer.parallel.FSDPParallel``);
    default one process and the plain model.
    """

    def __init__(self, model_path: str, args: LearnerArgs | None = None, parallel: Parallel | None = None, **kwargs):
        args = LearnerArgs(**kwargs) if args is None else replace(args, **kwargs)
        self.algorithm: Algorithm = make_algorithm(args.algo)
        if self.algorithm.needs_reference and args.reference_model_path is None:
            args = replace(args, reference_model_path=str(model_path))  # checkpoints keep the initial model
        self.args = args
        self.parallel = parallel or Parallel()
        torch.manual_seed(args.seed)
        self.model_path = str(model_path)
        self.device = torch.device(args.device)
        self.model = load_model(model_path, dtype=self.parallel.storage_dtype(args.dtype, args.master_weights),
                                device=self.parallel.load_device(self.device)).train()
        self.model.gradient_checkpointing = args.gradient_checkpointing
        self.model.checkpoint_layers = args.checkpoint_layers
        self.model.compile_elementwise = compiles_elementwise(args.compile_elementwise, self.device)
        self.tokenizer = load_tokenizer(model_path)
        self._hf_source = read_hf_source(model_path)  # model_path may be a checkpoint that gets pruned
        self.reference = self._load_reference() if self.algorithm.needs_reference else None
        self.optimizer: torch.optim.Optimizer | None = None  # made once the vocabulary is complete
        self.version = 0
        self._policies: dict[str, KVPolicy] = {}
        self.windows = TraceWindows(args, self.tokenizer, self.algorithm)  # each trace's windows and rows
        self.vocab_policy = self._bind(args.vocab_policy) if args.vocab_policy else None
        self._bind("full")  # grows the model when the tokenizer already has more tokens, as the engine does
        self._parallelize()
        if args.offload == "cpu":
            self._check_host_memory()
        self.optimizer = self._make_optimizer()
        self._padding: PackedWindows | None = None  # a zero-weight micro-batch, built on first use

    # ---- set-up -------------------------------------------------------------------------------
    def _load_reference(self):
        reference = load_model(self.args.reference_model_path, dtype=DTYPES[self.args.dtype],
                               device=self.parallel.load_device(self.device))
        if len(self.tokenizer) > reference.config.vocab_size:
            reference.resize_vocab(len(self.tokenizer))
        reference.compile_elementwise = compiles_elementwise(self.args.compile_elementwise, self.device)
        return reference.eval().requires_grad_(False)

    def _parallelize(self) -> None:
        """Wrap the model (and the frozen reference) for this learner's ranks; one process: nothing to do."""
        a = self.args
        self.model = self.parallel.parallelize(self.model, a.dtype, a.master_weights, a.reduce_dtype, a.offload)
        if self.reference is not None:
            self.reference = self.parallel.parallelize(self.reference, a.dtype, False, a.reduce_dtype, a.offload)

    def _check_host_memory(self) -> None:
        """Offloaded: every rank on this node will add its gradients and AdamW state to host memory at the first
        step; refuse now, with the numbers, if they cannot all fit (``parallel.check_host_memory``)."""
        host = socket.gethostname()
        needs = [need for h, need in self.parallel.gather((host, host_state_bytes(self.model))) if h == host]
        check_host_memory(needs, available_host_memory(), host)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return make_optimizer(self.model.parameters(), self.args.lr, self.args.weight_decay, self.args.adam_betas,
                              self.args.master_weights, self.parallel.optimizer_foreach)

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
                             f"vocab_policy={spec!r}")
        if self.parallel.sharded and self.optimizer is not None and any(t not in vocab for t in policy_tokens(policy)):
            raise ValueError(f"a {spec} trace needs tokens this learner's vocabulary lacks, and a sharded learner's "
                             f"vocabulary is fixed when it is built; build the Learner with vocab_policy={spec!r}")
        before = self.model.config.vocab_size
        bound = bind_policy_vocab(policy, self.tokenizer, self.model)
        if self.model.config.vocab_size != before:
            if self.reference is not None:
                self.reference.resize_vocab(self.model.config.vocab_size)
            if self.optimizer is not None:
                self.optimizer = self._make_optimizer()
        self._policies[spec] = bound
        return bound

    # ---- one step -----------------------------------------------------------------------------
    def step(self, groups: list[list[Trace]]) -> StepMetrics:
        """One optimizer step over ``groups`` (each the n traces of one prompt), accumulating over micro-batches.

        When no group carries a training signal nothing is stepped (``stepped`` False, version kept).
        Bad traces (unknown policy, wrong lengths, ids outside the vocabulary, non-finite sampler
        logprobs) raise ValueError; a non-finite loss or gradient raises FloatingPointError.
        """
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._check_groups(groups)
        self.windows.noise = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self.version)
        selection = self.algorithm.select(groups)
        units, inputs, skipped = self._units(selection)
        lr = self.args.lr_at(self.version)
        self.optimizer.zero_grad(set_to_none=True)
        if not units:  # the same on every rank: all of them see every group
            peak, peaks = self._peak_memory_gib()
            return StepMetrics(0.0, 0.0, None, None, None, 0, 0, 0, 0, 0, skipped, time.perf_counter() - start,
                               self.version, False, lr, dict(selection.metrics), peak, peaks)
        totals = self._totals(units)
        batches, most, num_batches = self._split_micro_batches(units, inputs)
        sums: dict[str, float] = {}
        self._nonfinite: str | None = None
        once = self.args.gradient_sync == "step"  # else FSDP2's default: every backward sums over the ranks
        for i in range(most):  # FSDP2's collectives need as many forwards/backwards on every rank: padding after
            if once:
                self.parallel.set_gradient_sync(self.model, i == most - 1)
            if i < len(batches):
                self._accumulate(batches[i], totals, sums)
            else:
                self._accumulate_padding()
        sums = self._reduce(sums)
        grad_norm = self._clip_and_step(lr)
        n, m = totals.num_loss_tokens, sums.get("_mismatch_tokens", 0.0)
        mean = lambda key: sums[key] / m if m else None  # noqa: E731
        weighted = {k.split("/", 1)[1]: v / n for k, v in sums.items() if k.startswith("_weighted/")}
        peak, peaks = self._peak_memory_gib()
        return StepMetrics(sums["loss"], grad_norm, mean("kl_mismatch"), mean("kl_mismatch_k1"),
                           sums.get("logprob_diff_max"), int(sums["num_tokens"]), n, totals.num_traces,
                           sum(len(u) for u in units), num_batches, skipped, time.perf_counter() - start,
                           self.version, True, lr, {**selection.metrics, **weighted}, peak, peaks)

    def _peak_memory_gib(self) -> tuple[float | None, tuple[float, ...] | None]:
        """CUDA: the most any rank allocated during the step, and each rank's (in rank order); CPU: None."""
        mine = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        peaks = self.parallel.gather(mine)
        return (None, None) if mine is None else (max(peaks), tuple(peaks))

    def _reduce(self, sums: dict[str, float]) -> dict[str, float]:
        """Every rank's metric sums added up (the largest logprob difference: the largest); a non-finite loss
        on any rank raises FloatingPointError on all of them, before the step."""
        parts = self.parallel.gather((sums, self._nonfinite))
        total = dict(parts[0][0])
        for other, _ in parts[1:]:
            for key, value in other.items():
                largest = key == "logprob_diff_max"
                total[key] = max(total.get(key, value), value) if largest else total.get(key, 0.0) + value
        failed = next((error for _, error in parts if error is not None), None)
        if failed is not None:
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(failed)
        return total

    def _check_groups(self, groups: list[list[Trace]]) -> None:
        for trace in (t for group in groups for t in group):
            self._trace_policy(trace)
            self._check_trace(trace)

    def _units(self, selection: Selection) -> tuple[list[list[Row]], dict[int, WindowInput], int]:
        """Rows that must share a micro-batch (a BoNBoN pair; else one window), each row's packable input
        (keyed by ``id(row)``), and how many traces had no loss token (their unit is dropped: a pair needs both)."""
        per_trace = [self._trace_rows(i, trace, selection.advantages[i], selection.roles[i], selection.group_sizes[i])
                     for i, trace in enumerate(selection.traces)]
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

    def _trace_rows(self, index: int, trace: Trace, advantage: float = 0.0, role: str = "",
                    group_size: int = 0) -> list[tuple[Row, WindowInput]]:
        """The trace's training windows under its own policy, those with a loss token, as (row, input)."""
        return self.windows.rows(index, trace, self._trace_policy(trace), advantage, role, group_size)

    def _trace_policy(self, trace: Trace) -> KVPolicy:
        try:
            return self._bind(trace.kv_policy)
        except ValueError as err:
            raise ValueError(f"trace {trace.trace_id!r}: {err}") from None

    def _check_trace(self, trace: Trace) -> None:
        check_trace(trace, self._trace_policy(trace), self.model.config.vocab_size, self.algorithm)

    def _totals(self, units: list[list[Row]]) -> Totals:
        per_trace: dict[int, int] = {}
        for row in (r for u in units for r in u):
            per_trace[row.trace_index] = per_trace.get(row.trace_index, 0) + int(row.loss_mask.sum())
        return Totals(sum(per_trace.values()), len(per_trace), len(units), per_trace)

    def _split_micro_batches(self, units: list[list[Row]],
                             inputs: dict[int, WindowInput]) -> tuple[list[MicroBatch], int, int]:
        """This rank's micro-batches from its share of the units (``Parallel.split``, by input tokens), the
        most micro-batches any rank has, and all ranks' total. Every rank works out every rank's packing."""
        sizes = [sum(inputs[id(r)].window.num_inputs for r in unit) for unit in units]
        shares = [self._pack([units[i] for i in part], inputs) for part in self.parallel.split(sizes)]
        mine = [MicroBatch(rows, pack_windows([inputs[id(r)] for r in rows])) for rows in shares[self.parallel.rank]]
        return mine, max(len(share) for share in shares), sum(len(share) for share in shares)

    def _micro_batches(self, units: list[list[Row]], inputs: dict[int, WindowInput]) -> list[MicroBatch]:
        return [MicroBatch(rows, pack_windows([inputs[id(r)] for r in rows])) for rows in self._pack(units, inputs)]

    def _pack(self, units: list[list[Row]], inputs: dict[int, WindowInput]) -> list[list[Row]]:
        """Greedy packing in order; a unit never splits, and one larger than the budget goes alone."""
        batches, current, size = [], [], 0
        for unit in units:
            tokens = sum(inputs[id(r)].num_inputs for r in unit)
            if current and size + tokens > self.args.micro_batch_tokens:
                batches.append(current)
                current, size = [], 0
            current += unit
            size += tokens
        return batches + ([current] if current else [])

    def _accumulate(self, batch: MicroBatch, totals: Totals, sums: dict[str, float]) -> None:
        """Forward, loss share, backward for one micro-batch; adds token-weighted metrics to ``sums``."""
        backend = self.args.attention
        logprobs = packed_logprobs(self.model, batch.packed, backend, device=self.device)
        for row, lp in zip(batch.rows, batch.packed.split(logprobs)):
            row.logprobs = lp
        if self.reference is not None:
            with torch.no_grad():
                ref = packed_logprobs(self.reference, batch.packed, backend, device=self.device)
            for row, lp in zip(batch.rows, batch.packed.split(ref)):
                row.ref_logprobs = lp
        for row in batch.rows:
            row.behaviour = row.behaviour.to(self.device) if row.behaviour is not None else None
            row.loss_mask = row.loss_mask.to(self.device)
        out = self.algorithm.loss(batch.rows, totals)
        if not torch.isfinite(out.loss):  # raised after the last micro-batch (_reduce), when every rank is there
            self._nonfinite = self._nonfinite or (
                f"non-finite loss {out.loss.item()} in a micro-batch of {len(batch.rows)} windows (traces "
                f"{sorted({r.trace_index for r in batch.rows})})")
            (sum(row.logprobs.sum() for row in batch.rows) * 0.0).backward()
            return
        out.loss.backward()
        self._add_metrics(batch, out.metrics, sums)

    def _accumulate_padding(self) -> None:
        """A micro-batch of weight 0 (one token), so that this rank's collectives line up with a busier rank's."""
        if self._padding is None:
            self._padding = pack_windows([window_input([0], [0], self._bind("full"), 1.0)])
        backend = self.args.attention  # the collectives of _accumulate, in its order: forward, reference, backward
        logprobs = packed_logprobs(self.model, self._padding, backend, device=self.device)
        if self.reference is not None:
            with torch.no_grad():
                packed_logprobs(self.reference, self._padding, backend, device=self.device)
        (logprobs.sum() * 0.0).backward()

    def _add_metrics(self, batch: MicroBatch, loss_metrics: dict[str, float], sums: dict[str, float]) -> None:
        add = lambda key, value: sums.__setitem__(key, sums.get(key, 0.0) + value)  # noqa: E731
        add("loss", loss_metrics.get("loss", 0.0))
        add("num_tokens", float(batch.packed.num_tokens))
        mask = torch.cat([r.loss_mask for r in batch.rows])
        for key, value in loss_metrics.items():
            if key not in ("loss", "num_loss_tokens"):
                add(f"_weighted/{key}", value * int(mask.sum()))
        sampled = [r for r in batch.rows if r.behaviour is not None]
        if not sampled:
            return
        mismatch = logprob_mismatch(torch.cat([r.behaviour for r in sampled]),
                                    torch.cat([r.logprobs.detach() for r in sampled]),
                                    torch.cat([r.loss_mask for r in sampled]))
        n = mismatch.num_tokens
        add("_mismatch_tokens", n)
        add("kl_mismatch", mismatch.kl * n)
        add("kl_mismatch_k1", mismatch.kl_k1 * n)
        sums["logprob_diff_max"] = max(sums.get("logprob_diff_max", 0.0), mismatch.max_abs)

    def _clip_and_step(self, lr: float) -> float:
        grad_norm = self.parallel.clip_grad_norm(self.model.parameters(), self.args.max_grad_norm)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {grad_norm}; the step was not taken")
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.version += 1
        return grad_norm

    # ---- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, groups: list[list[Trace]]) -> Evaluation:
        """Teacher-forced loss, token accuracy and exact match on the loss tokens of ``groups``' traces.

        No gradient, no step; every trace under its own policy and windows, as ``step`` trains it.
        A trace matches exactly when each of its loss tokens is the argmax, i.e. greedy decoding under
        its policy reproduces it (up to argmax ties). Sampler logprobs are not needed.
        """
        traces = [t for group in groups for t in group]
        for trace in traces:
            self._trace_policy(trace)
        self.windows.noise = None  # planned_diffusion: every span body token masked
        per_trace = [self._trace_rows(i, trace) for i, trace in enumerate(traces)]
        rows = [[row] for pairs in per_trace for row, _ in pairs]
        if not rows:
            raise ValueError("evaluate needs at least one trace with a loss token")
        inputs = {id(row): item for pairs in per_trace for row, item in pairs}
        nll, correct, wrong_traces, was_training = 0.0, 0, set(), self.model.training
        self.model.eval()
        try:
            for batch in self._micro_batches(rows, inputs):
                logits = packed_logits(self.model, batch.packed, self.args.attention, self.device)  # [M, V]
                targets = batch.packed.target_ids.to(logits.device)
                mask = torch.cat([r.loss_mask for r in batch.rows]).to(logits.device)
                nll -= float(logits.log_softmax(-1).gather(1, targets[:, None])[:, 0][mask].sum())
                hit = logits.argmax(-1) == targets
                correct += int(hit[mask].sum())
                for row, ok, m in zip(batch.rows, batch.packed.split(hit), batch.packed.split(mask)):
                    if not bool(ok[m].all()):
                        wrong_traces.add(row.trace_index)
        finally:
            self.model.train(was_training)
        n = sum(int(r.loss_mask.sum()) for (r,) in rows)
        num_traces = len({r.trace_index for (r,) in rows})
        return Evaluation(nll / n, correct / n, 1 - len(wrong_traces) / num_traces, num_traces)

    # ---- weights and checkpoints ----------------------------------------------------------------
    def state_dict(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """HF-named weights copied to ``device`` (tied ``lm_head.weight`` omitted: ``DecoderLM.load_weights``
        skips it anyway). Sharded: a collective, every rank gets them."""
        return {name: t.to(device, copy=True) for segment in self.weight_segments() for name, t in segment.items()}

    def weight_segments(self):
        """The full weights by HF name in segments (sharded: one unit all-gathered at a time, a collective);
        a segment's tensors are valid until the next is asked for."""
        return self.parallel.weight_segments(self.model)

    def save_checkpoint(self, path) -> Manifest:
        """The model in HF layout in ``path`` plus ``trainer_state.pt`` (optimizer, version, RNG, settings),
        and ``manifest.json`` listing each file's size and sha256; returns that manifest (a run's
        checkpoint adds its own files to it). Sharded: every rank calls it with the same folder (or one of
        its own, the files then gathered in one place); rank 0 writes the consolidated weights, the state
        and the manifest, and every rank its shards of the optimizer state (DCP; other ranks return an empty
        manifest)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        weights = self.parallel.gather_weights(self.model)
        training, shards = self.parallel.save_training_state(Path(path), self.model, self.optimizer)
        if self.parallel.rank != 0:
            return Manifest({})
        manifest = save_hf_model(self.model, self.tokenizer, self._hf_source, path, weights)
        for name, entry in shards.items():
            manifest.add(name, entry)
        manifest.add(TRAINER_STATE, save_trainer_state(path, {
            "version": self.version, **training, "rng": rng_state(), "args": asdict(self.args)}))
        manifest.write(path)
        return manifest

    @classmethod
    def from_checkpoint(cls, path, args: LearnerArgs | None = None, verify: bool = True,
                        parallel: Parallel | None = None) -> Learner:
        """Resume from ``save_checkpoint(path)``: weights, optimizer, version (so the lr schedule), RNG, whatever
        number of ranks saved it and ``parallel`` has.

        ``args``: the settings to continue with; default: the ones saved in the checkpoint.
        ``verify``: check the files against the checkpoint's manifest first (ValueError naming a damaged
        file); a run's driver has checked them already (``Checkpoints.latest``) and passes False.
        """
        if verify:
            check_intact(path)
        state = load_trainer_state(path)
        learner = cls(str(path), args or LearnerArgs.from_dict(state["args"]), parallel=parallel)
        learner.parallel.load_training_state(Path(path), state, learner.model, learner.optimizer)
        for group in learner.optimizer.param_groups:  # the saved groups bring the saving learner's choice
            group["foreach"] = learner.parallel.optimizer_foreach
        learner.version = int(state["version"])
        rngs = state.get("rank_rng") or [state["rng"]]
        set_rng_state(rngs[learner.parallel.rank] if learner.parallel.rank < len(rngs) else state["rng"])
        return learner


__all__ = ["Evaluation", "Learner", "LearnerArgs", "StepMetrics", "TRAINER_STATE"]
