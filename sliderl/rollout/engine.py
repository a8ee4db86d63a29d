"""The offline generation engine: ``LLM(model, kv=...).generate(prompts, SamplingParams(...))``.

One engine step: schedule (or take the decode step queued ahead), run the model, sample, postprocess.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass

import torch

from sliderl.core.loader import DTYPES, load_model, load_tokenizer
from sliderl.core.vocab import bind_policy_vocab
from sliderl.kernels.metadata import PagedKVCache
from sliderl.rollout.block_manager import BlockManager
from sliderl.rollout.engine_args import EngineArgs
from sliderl.rollout.mode import EngineContext
from sliderl.rollout.model_runner import ModelRunner
from sliderl.rollout.modes import make_mode
from sliderl.rollout.postprocess import Postprocessor
from sliderl.rollout.run_ahead import RunAhead
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.scheduler import ScheduledBatch, Scheduler
from sliderl.rollout.sequence import RequestOutput, Sequence, Status

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0
    queued_ahead: int = 0  # decode steps launched before the previous step's tokens were read
    register_kills: int = 0  # tokens that killed a register step (registers)
    max_running: int = 0  # most sequences running at once in any step
    max_concurrency: int = 0  # requests like the one with the largest block bound so far that run at once (0: none yet)


class LLM:
    """Paged-KV generation under a KV retention policy (see ``core.kv_policy``).

    Keywords are the fields of ``EngineArgs`` (their defaults and meaning are there), e.g.
    ``LLM(model, kv="prefix_sliding:4096", device="cuda", dtype="bfloat16")``; or pass a ready record,
    ``LLM(model, args=EngineArgs(...))`` (keywords then replace its fields). ``llm.args`` is the record.
    On CUDA, decode steps replay CUDA graphs unless ``cuda_graphs=False``, and with ``overlap`` the
    next decode step is queued before the current one's tokens are read back (``rollout.run_ahead``);
    outputs are the same either way.

    Under a bounded policy each request reserves its block bound on admission (``Sequence.block_bound``),
    so ``max_concurrency(prompt_len, max_tokens)`` requests of that shape run at once and none is ever
    preempted; a request whose bound alone exceeds the pool is refused by ``add_request``.
    The policy's decoding mode (``rollout.modes``) turns requests into sequences and sampled tokens into their
    state: under ``kv="pasta"`` every request runs the Pasta-Lang runtime (``rollout.pasta``), whose outputs are
    flattened responses with their forks (``PastaRequestOutput.pasta``).
    ``close()`` (or leaving ``with LLM(...) as llm:``) frees the KV pool, the weights and the CUDA graphs;
    ``sleep()`` frees the pool and the graphs only, until ``wake()`` (a learner colocated on the GPU uses
    the memory meanwhile).
    """

    def __init__(self, model: str, kv: str | None = None, *, args: EngineArgs | None = None, **keywords):
        if kv is not None:
            keywords["kv"] = kv
        self.args = args = EngineArgs.from_keywords(args, **keywords)
        self.device = torch.device(args.device)
        dtype = DTYPES[args.dtype]
        self.model = load_model(model, dtype=dtype, device=self.device)
        self.tokenizer = load_tokenizer(model)
        self.policy = bind_policy_vocab(args.kv, self.tokenizer, self.model)
        self.max_model_len = args.max_model_len or self.model.config.max_position_embeddings
        self.block_size = args.block_size
        num_blocks = args.num_blocks or self._blocks_for_memory(args.kv_cache_gb, dtype)
        h2o = self.policy.kind == "h2o"  # page mass is a per-step output (captured graphs write it to a static buffer)
        self.runner = ModelRunner(self.model, num_blocks, args.block_size, self.device, dtype, args.max_num_seqs,
                                  self.max_model_len, args.cuda_graphs, track_mass=h2o, gemv=args.gemv,
                                  pdl=args.pdl,
                                  register_ids=self.policy.register_ids if self.policy.kind == "registers" else None)
        self.scheduler = Scheduler(BlockManager(num_blocks), args.max_num_seqs, args.max_num_batched_tokens,
                                   self.max_model_len, admit_by_bound=self.policy.admits_by_bound,
                                   watermark_blocks=math.ceil(round(args.kv_watermark * num_blocks, 6)))
        overlap = args.overlap
        if overlap is None:  # registers too: a queued step masks the kills of its own input tokens (register_kills)
            overlap = self.device.type == "cuda"
        self.run_ahead = RunAhead(self.runner, self.scheduler, overlap)
        self.eos_ids = self._eos_ids(model)
        self.mode = make_mode(EngineContext(self.scheduler, self.policy, self.tokenizer, frozenset(self.eos_ids),
                                            self.block_size, self.max_model_len, args.max_num_batched_tokens,
                                            self.runner), args)
        self.postprocess = Postprocessor(self.tokenizer, self.eos_ids, self.max_model_len, self.scheduler,
                                         self.runner.set_death, self.mode)
        self.stats = EngineStats()
        self._next_id = 0
        self.closed = False
        self.asleep = False  # sleep(): the KV pool and the CUDA graphs are freed until wake()

    # ---- set-up -------------------------------------------------------------------------------
    def _blocks_for_memory(self, kv_cache_gb: float | None, dtype: torch.dtype) -> int:
        cfg = self.model.config
        per_block = PagedKVCache.bytes_per_block(cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        if kv_cache_gb is None:
            if self.device.type == "cuda":  # leave room for activations, logits and graphs
                free, _ = torch.cuda.mem_get_info(self.device)
                return max(1, int(free * 0.9 - 4 * 2**30) // per_block)
            kv_cache_gb = 1.0
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
        self._check_open()
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
        """Queue one request; its ``Sequence`` (``output(seq)`` once it finished).

        Raises ValueError for a bad prompt, or when the request's block bound alone exceeds the KV pool
        (it could not run even alone).
        """
        self._check_open()
        ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        self._check_prompt(ids)
        rid = self._next_id
        seed = params.seed if params.seed is not None else (self.args.seed * 1_000_003 + rid) % (2**31)
        seq = self.mode.new_request(rid, ids, params, seed, time.perf_counter())
        self._check_pool(seq)
        self._next_id += 1
        self._note_concurrency(seq)
        self.scheduler.add(seq)
        return seq

    def force(self, seq: Sequence, tokens: list[int], thread: int = 0) -> None:
        """Teacher forcing (``rollout.forcing``): thread ``thread`` of ``seq``'s request takes ``tokens`` in order in
        place of the tokens it samples, then samples on. Thread 0 is the request (its main thread under pasta);
        thread k >= 1 its k-th Pasta fork, whose tokens start after the ``<async>`` the runtime inserts.

        Raises ValueError for a thread the mode does not have (only 0 outside ``kv="pasta"``), or a token outside
        the vocabulary.
        """
        self._check_open()
        self.mode.check_thread(thread)
        vocab = self.model.config.vocab_size
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"forced token {bad[0]!r} is outside the vocabulary [0, {vocab})")
        self.runner.forced.add(seq.request_id, thread, tokens)

    def max_concurrency(self, prompt_len: int, max_tokens: int) -> int:
        """How many requests of ``prompt_len`` prompt tokens and up to ``max_tokens`` generated ones run
        at once: the pool over one's block bound, at most ``max_num_seqs``. Exact under a bounded
        policy; under full and registers, the count that fits if every request reaches its bound
        (more start while they are short, and preemption sorts it out)."""
        return self._concurrency(self.mode.block_bound(prompt_len, max_tokens))

    def load_weights(self, weights) -> None:
        """Replace the model's weights in place (a state dict or ``(name, tensor)`` pairs).

        A decode step queued with the old weights is dropped: every token sampled after this call
        comes from the new weights.
        """
        self._check_open()
        self.run_ahead.drop()
        self.model.load_weights(weights)

    def sleep(self) -> None:
        """Free the KV pool and the CUDA graphs (the weights stay), e.g. while a learner on the same GPU takes
        a step; ``wake()`` allocates them again. Waiting requests stay queued; a running one (holding KV)
        is an error. ``step()`` refuses to run until ``wake()``. Sleeping again does nothing."""
        self._check_open()
        if self.asleep:
            return
        if self.scheduler.running:
            raise RuntimeError(f"sleep() frees the KV pool, but {len(self.scheduler.running)} running requests "
                               "still hold KV in it; let them finish first")
        self.run_ahead.drop()
        self.runner.release()
        self.asleep = True
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Allocate the KV pool (same size, zeroed) and capture the CUDA graphs again after ``sleep()``."""
        self._check_open()
        if self.asleep:
            self.runner.allocate()
            self.asleep = False

    def has_unfinished(self) -> bool:
        """True while a request added is not finished."""
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Free the device memory the engine holds: the queued step, the CUDA graphs, the KV pool and the
        weights (and, on CUDA, hand the cached memory back), so another engine fits in this process.

        Unfinished requests are dropped; every later call raises. Closing again does nothing.
        """
        if self.closed:
            return
        self.closed = True
        self.runner.close()
        self.model = self.runner = self.run_ahead = self.postprocess = self.mode = None
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        if self.device.type == "cuda":
            gc.collect()  # whatever a caller's reference cycle still holds goes before the cache is emptied
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this LLM was closed (close() freed its weights and KV pool); build a new LLM")

    def _check_pool(self, seq: Sequence) -> None:
        pool = self.scheduler.blocks.num_blocks
        if seq.block_bound > pool:
            smaller = self.mode.smaller_request()
            raise ValueError(
                f"a request of {seq.prompt_len} prompt tokens and max_tokens={seq.params.max_tokens} may hold "
                f"{seq.block_bound} KV blocks of {self.block_size} tokens under {self.policy.spec} "
                f"(max_model_len={self.max_model_len}), more than the whole pool of {pool} blocks; "
                f"raise num_blocks / kv_cache_gb, or lower {smaller}")

    def _concurrency(self, bound: int) -> int:
        return min(self.args.max_num_seqs, self.scheduler.blocks.num_blocks // bound)

    def _note_concurrency(self, seq: Sequence) -> None:
        """``stats.max_concurrency`` for the largest bound so far; logged when it first is set or drops."""
        concurrency = self._concurrency(seq.block_bound)
        if self.stats.max_concurrency and concurrency >= self.stats.max_concurrency:
            return
        self.stats.max_concurrency = concurrency
        logger.info("KV pool of %d blocks x %d tokens under %s: a request of %d prompt tokens and max_tokens=%d "
                    "holds at most %d blocks, so %d such requests run at once (max_num_seqs=%d)",
                    self.scheduler.blocks.num_blocks, self.block_size, self.policy.spec, seq.prompt_len,
                    seq.params.max_tokens, seq.block_bound, concurrency, self.args.max_num_seqs)

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

        With overlap the forward may be the decode step the previous call queued ahead (see
        ``rollout.run_ahead``); this call then queues the next one before reading its own tokens back.
        """
        self._check_open()
        if self.asleep:
            raise RuntimeError("this LLM is asleep (sleep() freed its KV pool); call wake() before stepping it")
        t0 = time.perf_counter()
        flight = self.run_ahead.take()
        if flight is None:
            flight = self.run_ahead.launch(self.scheduler.schedule())
        running = len(self.scheduler.running)
        tokens, logprobs = self.runner.sample(flight.sampling_seqs(), flight.logits)
        read = self.run_ahead.read_back(tokens, logprobs, *flight.mass_values())  # copied before the next step is queued
        self.run_ahead.queue_next(flight, tokens)
        tokens, logprobs, *mass = read()
        flight.add_mass(*mass)  # h2o: pages' attention mass, for the evictions of later steps
        finished = self.postprocess(flight.batch, flight.rows, tokens, logprobs, flight.logits)
        for seq in finished:
            self.runner.forced.discard(seq.request_id)
        self._count(flight.batch, running, time.perf_counter() - t0)
        return finished

    def _count(self, batch: ScheduledBatch, running: int, seconds: float) -> None:
        self.stats.steps += 1
        self.stats.max_running = max(self.stats.max_running, running)
        self.stats.seconds += seconds
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.queued_ahead = self.run_ahead.num_queued
        self.stats.register_kills = self.postprocess.num_kills
        decode = sum(1 for n in batch.num_tokens if n == 1)
        self.stats.decode_tokens += decode
        self.stats.prefill_tokens += sum(batch.num_tokens) - decode

    def output(self, seq: Sequence) -> RequestOutput:
        """The output record of a finished request (from ``add_request``)."""
        self._check_open()
        return self.postprocess.output(seq)


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="generate", unit="req")
