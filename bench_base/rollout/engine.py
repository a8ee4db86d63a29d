"""The offline generation engine: ``LLM(model, kv=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from rollout.block_manager import BlockManager
from rollout.kv_policy import KVPolicy
from rollout.loader import load_model, load_tokenizer
from rollout.model_runner import ModelRunner
from rollout.sampling import SamplingParams, logprobs_at, sample
from rollout.scheduler import ScheduledBatch, Scheduler
from rollout.sequence import RequestOutput, Sequence, Status
from rollout.vocab import bind_policy_vocab
from kernels.metadata import PagedKVCache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0
    queued_ahead: int = 0  # decode steps launched before the previous step's tokens were read
    redone_rows: int = 0  # rows of queued steps computed again because a register kill changed what they see


class LLM:
    """Paged-KV generation under a KV retention policy (see ``rollout.kv_policy``).

    ``kv``: ``full``, ``prefix_sliding:W``, ``sliding_window:W``, ``streaming:S:W`` or ``registers:N``.
    The pool holds ``num_blocks`` blocks of ``block_size`` tokens (or as many as ``kv_cache_gb`` allows).
    On CUDA, decode steps replay CUDA graphs unless ``cuda_graphs=False``, and with ``overlap`` the
    next decode step is queued before the current one's tokens are read back (see ``step``); outputs
    are the same either way. ``overlap=None`` (default) turns it on for CUDA under every policy but
    ``registers``, whose overlap (redoing a row after each register kill) is on only with ``overlap=True``.
    """

    def __init__(self, model: str, kv: str = "full", *, device: str = "cpu", dtype: str = "float32",
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_gb: float | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, max_model_len: int | None = None,
                 seed: int = 0, cuda_graphs: bool = True, overlap: bool | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; valid: {sorted(DTYPES)}")
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.device = torch.device(device)
        self.policy = KVPolicy.parse(kv)
        self.model = load_model(model, dtype=DTYPES[dtype], device=self.device)
        self.tokenizer = load_tokenizer(model)
        self.policy = bind_policy_vocab(self.policy, self.tokenizer, self.model)
        cfg = self.model.config
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.block_size = block_size
        num_blocks = num_blocks or self._blocks_for_memory(kv_cache_gb, DTYPES[dtype])
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.device, DTYPES[dtype], max_num_seqs,
                                  self.max_model_len, cuda_graphs)
        self.scheduler = Scheduler(BlockManager(num_blocks), max_num_seqs, max_num_batched_tokens)
        self.eos_ids = self._eos_ids(model)
        self.seed = seed
        self.stats = EngineStats()
        self._next_id = 0
        self._encoded: dict[str, tuple[int, ...]] = {}
        self.overlap = self.device.type == "cuda" and self.policy.kind != "registers" if overlap is None else overlap
        self._ahead: _Flight | None = None  # a decode step queued before the previous one's tokens were read

    # ---- set-up -------------------------------------------------------------------------------
    def _blocks_for_memory(self, kv_cache_gb: float | None, dtype: torch.dtype) -> int:
        cfg = self.model.config
        per_block = PagedKVCache.bytes_per_block(cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        if kv_cache_gb is None:
            if self.device.type == "cuda":  # leave room for activations, logits and graphs
                free, _ = torch.cuda.mem_get_info(self.device)
                return max(1, int(free * 0.9 - 4 * 2**30) // per_block)
            kv_cache_gb = 1.0
        if kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {kv_cache_gb}")
        return max(1, int(kv_cache_gb * 2**30) // per_block)

    def _eos_ids(self, model: str) -> set[int]:
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        try:
            from transformers import GenerationConfig
            eos = GenerationConfig.from_pretrained(model, local_files_only=True).eos_token_id
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:
            pass
        return ids

    # ---- public API ---------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order."""
        prompts = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
        params = params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        bar = _progress(len(seqs)) if use_tqdm else None
        while any(s.status is not Status.FINISHED for s in seqs):
            for seq in self.step():
                bar and bar.update(1)
        bar and bar.close()
        return [self.output(s) for s in seqs]

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        self._check_prompt(ids)
        rid = self._next_id
        self._next_id += 1
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + rid) % (2**31)
        seq = Sequence(rid, ids, params, seed, self.policy.tracker(len(ids)), self.block_size, time.perf_counter())
        self.scheduler.add(seq)
        return seq

    def load_weights(self, weights) -> None:
        """Replace the model's weights in place (a state dict or ``(name, tensor)`` pairs).

        A decode step queued with the old weights is dropped: every token sampled after this call
        comes from the new weights.
        """
        self._ahead = None
        self.model.load_weights(weights)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("empty prompt: a prompt needs at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len} "
                             "(it must leave room for at least one generated token)")
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.model.config.vocab_size})")

    # ---- one engine step: schedule, run, postprocess -------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one forward over the scheduled batch; returns the sequences that finished.

        With ``overlap``, a pure decode step queues the next one on the GPU before reading its own
        sampled tokens back (the next step's inputs are copied from them on the device), so the host's
        bookkeeping of step t runs while the GPU computes step t + 1. A queued step whose sequence
        finished is wasted work for that row only; one whose inputs would be wrong (new weights) is
        dropped before it is used, and its K/V writes are redone by the step that replaces it. Under
        ``registers``, a row whose sampled register killed a step saw that step's keys in the queued
        forward: that row alone is computed again (same slot, so its K/V is overwritten) before sampling.
        """
        t0 = time.perf_counter()
        flight, self._ahead = self._ahead, None
        if flight is not None:
            flight = flight.without_finished(self.runner.host_tensor)
        if flight is not None and flight.redo:
            self._redo(flight)
        if flight is None:
            batch = self.scheduler.schedule()
            rows = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                    if s.num_computed + n == len(s.token_ids)]
            flight = _Flight(batch, rows, self.runner.run(batch, rows))
        tokens, logprobs = self._sample([flight.batch.seqs[i] for i in flight.rows], flight.logits)
        read = self._read_back(tokens, logprobs)  # queued before the next step, so it need not wait for it
        self._ahead = self._queue_next(flight, tokens)
        finished, killers = self._postprocess(flight, *read())
        if killers and self._ahead is not None:
            self._ahead.redo = killers
        self._count(flight.batch, flight.rows, time.perf_counter() - t0)
        return finished

    def _read_back(self, *tensors: torch.Tensor):
        """Start copying ``tensors`` to the host; the returned function waits for them and gives lists.

        ``tensor.tolist()`` would wait for everything queued on the stream, the next step included.
        """
        if self.device.type != "cuda":
            return lambda: [t.tolist() for t in tensors]
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> list[list]:
            done.synchronize()
            return [h.tolist() for h in host]
        return wait

    def _queue_next(self, flight: _Flight, tokens: torch.Tensor) -> _Flight | None:
        """Launch the next decode step of ``flight``'s sequences now, their inputs being ``tokens`` (on the device).

        Only when the step is certain to be needed as launched: every sequence samples this step, no
        request waits for admission (they would be starved), no budget forcing can replace a sampled
        token, every sequence stays within ``max_model_len``, and the pool has the blocks without
        preempting anyone. (A register kill is only known once the tokens are read: ``step`` redoes
        the rows it affects.)
        """
        batch, bs = flight.batch, self.block_size
        if not self.overlap or self.scheduler.waiting or len(flight.rows) != len(batch.seqs):
            return None
        new_blocks = 0
        for seq in batch.seqs:
            p = seq.params
            if seq.pending_forced or (p.max_thinking_tokens is not None and not seq.thinking_done) \
                    or len(seq.token_ids) + 2 > self.max_model_len:
                return None
            new_blocks += len(seq.token_ids) // bs not in seq.blocks
        if new_blocks > self.scheduler.blocks.num_free:
            return None
        nxt = ScheduledBatch()
        for seq, n in zip(batch.seqs, batch.num_tokens):
            self._mark_computed(seq, n)
            self.scheduler.free_dead_blocks(seq)  # the GPU reads them in this step, before the next writes
            self.scheduler.allocate(seq, 1)
            nxt.add(seq, 1)
        flight.marked = True
        self.stats.queued_ahead += 1
        rows = list(range(len(nxt)))
        return _Flight(nxt, rows, self.runner.run(nxt, rows, input_ids=tokens))

    def _redo(self, flight: _Flight) -> None:
        """Compute again the rows of a queued step whose sequence killed a register step meanwhile.

        The queued forward ran before the kill reached the cache's deaths, so these rows attended to
        the dead step; the new forward writes the same slots and replaces their logits.
        """
        rows = [k for k, i in enumerate(flight.rows) if flight.batch.seqs[i].request_id in flight.redo]
        if not rows:
            return
        batch = ScheduledBatch([flight.batch.seqs[flight.rows[k]] for k in rows], [1] * len(rows))
        logits = self.runner.run(batch, list(range(len(rows))))
        index = self.runner.host_tensor(rows, torch.long).to(logits.device, non_blocking=True)
        with torch.inference_mode():  # the logits are inference tensors
            flight.logits.index_copy_(0, index, logits)
        self.stats.redone_rows += len(rows)

    def _count(self, batch: ScheduledBatch, rows: list[int], seconds: float) -> None:
        self.stats.steps += 1
        self.stats.seconds += seconds
        self.stats.preemptions = self.scheduler.num_preemptions
        decode = sum(1 for n in batch.num_tokens if n == 1)
        self.stats.decode_tokens += decode
        self.stats.prefill_tokens += sum(batch.num_tokens) - decode

    def _postprocess(self, flight: _Flight, tokens: list[int],
                     logprobs: list[float]) -> tuple[list[Sequence], set[int]]:
        """Append the sampled tokens; the sequences that finished, and the request ids whose token killed a step."""
        batch = flight.batch
        if not flight.marked:
            for seq, n in zip(batch.seqs, batch.num_tokens):
                self._mark_computed(seq, n)
        finished, killers = [], set()
        for row, i in enumerate(flight.rows):
            seq = batch.seqs[i]
            if self._append(seq, tokens[row], logprobs[row], flight.logits[row]):
                killers.add(seq.request_id)
            if self._check_finish(seq):
                self._finish(seq)
                finished.append(seq)
        for seq in batch.seqs:
            if seq.status is Status.RUNNING:
                self.scheduler.free_dead_blocks(seq)
        return finished, killers

    def _mark_computed(self, seq: Sequence, n: int) -> None:
        bs = self.block_size
        before, seq.num_computed = seq.num_computed, seq.num_computed + n
        for j in range(before // bs, seq.num_computed // bs):
            seq.block_completed(j)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and logprobs of ``seqs`` (rows of ``logits``), left on the device."""
        dev = logits.device
        if not seqs:
            return torch.empty(0, dtype=torch.long, device=dev), torch.empty(0, device=dev)
        col = lambda values, dtype: self.runner.host_tensor(values, dtype).to(dev, non_blocking=True)  # noqa: E731
        params = [s.params for s in seqs]
        return sample(
            logits,
            col([p.temperature for p in params], torch.float32),
            col([p.top_p for p in params], torch.float32),
            col([p.top_k for p in params], torch.int64),
            col([s.seed for s in seqs], torch.int64),
            col([s.num_output for s in seqs], torch.int64),
            all_greedy=all(p.temperature <= 0 for p in params),
            any_truncation=any(p.top_k > 0 or p.top_p < 1 for p in params),
        )

    def _append(self, seq: Sequence, token: int, logprob: float, logits: torch.Tensor) -> bool:
        """Record the token (or the one budget forcing puts in its place); whether it killed a register step."""
        p = seq.params
        if p.max_thinking_tokens is not None and not seq.thinking_done and not seq.pending_forced \
                and seq.num_output >= p.max_thinking_tokens:
            seq.pending_forced = list(self._token_ids(p.think_end))
        forced = bool(seq.pending_forced)
        if forced:
            token = seq.pending_forced.pop(0)
            temp = torch.tensor([p.temperature], device=logits.device)
            logprob = float(logprobs_at(logits[None], torch.tensor([token], device=logits.device), temp)[0])
        killed = seq.append_token(token, logprob, forced)
        if p.max_thinking_tokens is not None and not seq.thinking_done:
            end = list(self._token_ids(p.think_end))
            seq.thinking_done = seq.output_token_ids[-len(end):] == end
        if killed:
            self._kill(seq, killed)
        return bool(killed)

    def _token_ids(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text`` (cached: budget forcing asks for them every step)."""
        if text not in self._encoded:
            self._encoded[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return self._encoded[text]

    def _kill(self, seq: Sequence, ranges: list[tuple[int, int]]) -> None:
        """Registers: cached keys of a dead step get their death; complete blocks may now be freed."""
        bs, r = self.block_size, len(seq.token_ids) - 1
        slots, touched = [], set()
        for start, end in ranges:
            for p in range(start, min(end, seq.num_computed)):
                if p // bs in seq.blocks:
                    slots.append(seq.blocks[p // bs] * bs + p % bs)
                    touched.add(p // bs)
        if slots:
            self.runner.set_death(slots, r)
        for j in touched:
            if (j + 1) * bs <= seq.num_computed:
                seq.push_free_candidate(j)

    def _check_finish(self, seq: Sequence) -> bool:
        p, token = seq.params, seq.token_ids[-1]
        if not seq.forced[-1] and ((token in self.eos_ids and not p.ignore_eos) or token in (p.stop_token_ids or ())):
            seq.finish_reason = "stop"
        elif p.stop and self._stop_string(seq) is not None:
            seq.finish_reason = "stop"
        elif seq.num_output >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _stop_string(self, seq: Sequence, text: str | None = None) -> int | None:
        """Index in ``text`` (default: the decoded tail) where the earliest stop string starts."""
        if text is None:
            tail = max(len(s) for s in seq.params.stop) + 4
            text = self.tokenizer.decode(seq.output_token_ids[-tail:])
        hits = [text.find(s) for s in seq.params.stop if s in text]
        return min(hits) if hits else None

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        n = max(seq.num_output, 1)
        seq.kv.mean_visible_tokens = seq.visible_sum / n
        seq.finished_at = time.perf_counter()

    def output(self, seq: Sequence) -> RequestOutput:
        """The output record of a finished request (from ``add_request``)."""
        out = seq.output_token_ids
        shown = out[:-1] if out and out[-1] in self.eos_ids and seq.finish_reason == "stop" else out
        text = self.tokenizer.decode(shown)
        if seq.params.stop:
            cut = self._stop_string(seq, text)
            text = text if cut is None else text[:cut]
        return RequestOutput(seq.request_id, seq.prompt_token_ids, out, seq.logprobs, text, seq.finish_reason,
                             seq.kv, seq.forced, seq.num_preemptions, seq.finished_at - seq.arrival)


@dataclass
class _Flight:
    """A launched forward: its batch, the rows that sample, their logits (still being computed)."""

    batch: ScheduledBatch
    rows: list[int]
    logits: torch.Tensor
    marked: bool = False  # its tokens were marked computed when the next step was queued
    redo: set[int] = field(default_factory=set)  # request ids whose rows must be computed again (see _redo)

    def without_finished(self, host_tensor) -> _Flight | None:
        """This queued decode step minus the sequences that finished meanwhile; None if none is left."""
        keep = [i for i in self.rows if self.batch.seqs[i].status is Status.RUNNING]
        if len(keep) == len(self.rows):
            return self
        if not keep:
            return None
        batch = ScheduledBatch([self.batch.seqs[i] for i in keep], [self.batch.num_tokens[i] for i in keep])
        index = host_tensor(keep, torch.long).to(self.logits.device, non_blocking=True)
        return _Flight(batch, list(range(len(keep))), self.logits[index], redo=self.redo)


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="generate", unit="req")
