"""Steady-state decode throughput of the engine on a Qwen3-1.7B-config model (random bf16 weights).

    python benchmarks/engine_gpu.py [--positions 8192 32768 131072] [--window 4096] [--steps 48] [--out F]
    python benchmarks/engine_gpu.py --positions 8192 --policies prefix_sliding:4096 --max-seqs 1 --hf-batch 0 \
        --steps 64 --profile 32 --gemv on off        # batch-1 latency, Triton GEMV vs cuBLAS in one run
    python benchmarks/engine_gpu.py --positions 8192 --policies prefix_sliding:4096 --max-seqs 1 --hf-batch 0 \
        --steps 64 --profile 32 --gemv off on --pdl off on   # and each with the decode step as a PDL chain

How the cache reaches a position X: each sequence has a 100-token prompt; its history up to X is
synthesised instead of generated — the token ids are a filler token (registers: a register token every
256 tokens, cycling over 16 registers), the KV policy's tracker is run over them, and only the blocks
some future query can still see are allocated and filled with random K/V with their true death
positions. Dead blocks are never allocated (they would never be read). Then the engine decodes
``--steps`` real steps (CUDA graphs, Triton kernels, sampling on the GPU) and we time the last
``steps - warmup`` of them. Under ``registers`` the traffic goes on while decoding: each sequence's
sampled token is replaced by its next register every 256 tokens, the sequences staggered so that
about batch/256 of them kill a step at every engine step (the step queued ahead masks each kill itself).
Under ``h2o:B`` the history keeps the budget's pages (the recent half and older pages spread evenly)
and the engine evicts by the attention mass its decode kernel outputs (from CUDA graphs as for every policy).
The batch is sized to the KV memory budget (at most 256 sequences).
transformers' ``generate`` (static cache, greedy) on the same model is the peer row.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from sliderl.rollout import LLM, SamplingParams  # noqa: E402
from sliderl.rollout.sequence import Status  # noqa: E402

PROMPT = 100
STEP_TOKENS = 256  # registers: a register token every this many tokens after the prompt


def build_model(root: Path) -> Path:
    """Qwen3-1.7B config with random bf16 weights (built on the GPU), saved with the tiny byte tokenizer."""
    from sliderl.core.tiny import make_qwen3_1p7b
    return make_qwen3_1p7b(root)


def history(llm: LLM, position: int) -> tuple[list[int], object]:
    """Token ids up to ``position`` and a tracker that has followed them (shared by all sequences)."""
    filler = 65
    ids = [filler] * position
    if llm.policy.kind == "registers":
        regs = llm.policy.register_ids
        for i, p in enumerate(range(PROMPT, position, STEP_TOKENS)):
            ids[p] = regs[i % len(regs)]
    tracker = llm.policy.tracker(PROMPT)
    for p in range(position):
        tracker.append(p, ids[p])
    if llm.policy.kind == "h2o":  # evict every page but the budget's: the recent ones and evenly spread heavy ones
        keep = h2o_pages(llm, position)
        for j in range(position // llm.block_size + 1):
            if j not in keep:
                tracker.evict(j * llm.block_size, (j + 1) * llm.block_size, position)
    return ids, tracker


def h2o_pages(llm: LLM, position: int) -> set[int]:
    """h2o: the logical pages a sequence at ``position`` holds in the synthesised state — the budget's
    ``recent`` pages up to the one being written, and ``budget - recent`` older heavy pages spread
    evenly over the history (which pages is immaterial to the speed: the kernel reads the same count)."""
    budget, recent = llm.policy.budget_pages(llm.block_size)
    last = position // llm.block_size
    older = last - recent + 1
    heavy = budget - recent
    return set(range(older, last + 1)) | {round(i * (older - 1) / max(heavy - 1, 1)) for i in range(heavy)}


def place(llm: LLM, n: int, position: int, max_new: int) -> None:
    """Put ``n`` running sequences at ``position`` (see the module docstring)."""
    ids, tracker = history(llm, position)
    bs = llm.block_size
    live = [j for j in range(position // bs + 1)
            if j == position // bs or max(tracker.death[j * bs:(j + 1) * bs]) > position]
    death_rows = torch.tensor([tracker.death[j * bs:(j + 1) * bs] + [0] * (bs - len(tracker.death[j * bs:(j + 1) * bs]))
                               for j in live], dtype=torch.int32)
    params = SamplingParams(max_tokens=position - PROMPT + 1 + max_new, temperature=0.0, ignore_eos=True)
    for _ in range(n):
        seq = llm.add_request(ids[:PROMPT], params)
        llm.scheduler.waiting.remove(seq)
        seq.tracker = copy.deepcopy(tracker)
        seq.tracker.append(position, ids[-1])
        seq.token_ids = list(ids) + [ids[-1]]
        blocks = [llm.scheduler.blocks.allocate() for _ in live]
        for j, b in zip(live, blocks):
            seq.add_block(j, b)
        llm.runner.cache.death[torch.tensor(blocks, device=llm.device)] = death_rows.to(llm.device)
        seq.num_computed = position
        for j in live[:-1]:
            seq.block_completed(j)
        if seq.heavy is not None:  # h2o: the history's mass is scored; heavy pages carry some mass
            seq.heavy.scored_through = position
            seq.heavy.set_mass(live, 1.0)
        seq.status = Status.RUNNING
        llm.scheduler.running.append(seq)


def inject_registers(llm: LLM, position: int) -> None:
    """Registers: every STEP_TOKENS tokens a sequence's sampled token becomes its next register in the
    cycle (the one whose step is oldest), killing that step; the replacement happens on the device,
    so the overlapped engine's queued step reads it. The n sequences' turns are offset by
    i·256/n tokens, so that every engine step has n/256 kills (give or take one)."""
    regs, sample = llm.policy.register_ids, llm.runner.sample
    turn: dict[int, int] = {}  # request id -> registers emitted so far (history's included)
    emitted = len(range(PROMPT, position, STEP_TOKENS))  # the registers history() wrote
    running = sorted(s.request_id for s in llm.scheduler.running)
    offset = {rid: i * STEP_TOKENS // len(running) for i, rid in enumerate(running)}  # even over the cycle

    def sample_with_registers(seqs, logits):
        tokens, logprobs = sample(seqs, logits)
        due = [i for i, s in enumerate(seqs) if (len(s.token_ids) + offset[s.request_id]) % STEP_TOKENS == 0]
        if due:
            ids = []
            for i in due:
                k = turn.get(seqs[i].request_id, emitted)
                ids.append(regs[k % len(regs)])
                turn[seqs[i].request_id] = k + 1
            host = llm.runner.host_tensor
            tokens[host(due, torch.long).to(tokens.device, non_blocking=True)] = host(ids, torch.long).to(
                tokens.device, non_blocking=True)
        return tokens, logprobs
    llm.runner.sample = sample_with_registers


def decode_rate(llm: LLM, steps: int, warmup: int) -> tuple[float, dict]:
    """Tokens per second over the timed steps, and the wall ms per step split by whether the step's tokens
    killed a register step (registers) and Python's garbage-collector ms in the window: a slow step class
    or collector pauses show in the split even when the mean hides them."""
    import gc
    for _ in range(warmup):
        llm.step()
    torch.cuda.synchronize()
    collecting, gc_s = [0.0], [0.0]

    def on_gc(phase, info):
        if phase == "start":
            collecting[0] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - collecting[0]
    gc.callbacks.append(on_gc)
    by_kind: dict[str, list[float]] = {"kill": [], "plain": []}
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(steps - warmup):
        tokens += len(llm.scheduler.running)
        kills, t = llm.stats.register_kills, time.perf_counter()
        llm.step()
        by_kind["kill" if llm.stats.register_kills > kills else "plain"].append(1e3 * (time.perf_counter() - t))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    split = {f"{k}_steps": len(v) for k, v in by_kind.items()}
    split.update({f"{k}_ms_mean": sum(v) / len(v) for k, v in by_kind.items() if v})
    split.update({f"{k}_ms_max": max(v) for k, v in by_kind.items() if v})
    split["gc_ms_per_step"] = 1e3 * gc_s[0] / max(steps - warmup, 1)
    return tokens / seconds, split


def sync_sites(llm: LLM, steps: int) -> dict[str, int]:
    """Run ``steps`` engine steps under ``torch.cuda.set_sync_debug_mode("warn")``; for each call that made
    the host wait for the device, the engine's innermost frame (file:line function) and how often."""
    import collections
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/rollout/" in f.filename or "/kernels/" in f.filename]
        where = frames[-1] if frames else traceback.extract_stack()[-2]
        sites[f"{Path(where.filename).name}:{where.lineno} {where.name}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                llm.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sites.most_common())


@contextlib.contextmanager
def serial_steps(llm: LLM):
    """Steps with ``overlap`` off, after running the step already queued ahead (outside any timer)."""
    overlap, llm.run_ahead.enabled = llm.run_ahead.enabled, False
    llm.step()
    torch.cuda.synchronize()
    try:
        yield
    finally:
        llm.run_ahead.enabled = overlap


def step_breakdown(llm: LLM, steps: int) -> dict:
    """Milliseconds per step spent in the model forward (synchronised) and around it (host work).

    Measured serially (a synchronised forward cannot overlap anything): the parts of a step, whose
    sum the overlapped engine hides down to max(GPU, host).
    """
    run, inside = llm.runner.run, []

    def timed_run(*args, **kwargs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = run(*args, **kwargs)
        torch.cuda.synchronize()
        inside.append(time.perf_counter() - t)
        return out

    with serial_steps(llm):
        llm.runner.run = timed_run
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        total = (time.perf_counter() - t0) / steps
        llm.runner.run = run
    forward = sum(inside) / steps
    return {"step_ms": 1e3 * total, "forward_ms": 1e3 * forward, "host_ms": 1e3 * (total - forward)}


def kernel_profile(llm: LLM, steps: int, top: int = 12) -> dict:
    """GPU milliseconds per step by kernel (torch.profiler over ``steps`` engine steps, graphs included).

    Steps run serially, so that the window holds exactly ``steps`` forwards.
    """
    from torch.profiler import ProfilerActivity, profile
    with serial_steps(llm), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    launches_total = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            launches_total += 1
            name = e.name if len(e.name) <= 60 else e.name[:57] + "..."
            per_kernel[name] = per_kernel.get(name, 0.0) + e.time_range.elapsed_us() / 1e3 / steps
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    # the top kernel's launches of one step in launch order (us): which layer's launch is slow, when one is
    first = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                    and e.name.startswith(ranked[0][0].removesuffix("..."))), key=lambda e: e.time_range.start)
    per_step = len(first) // steps
    launches = [round(e.time_range.elapsed_us(), 1) for e in first[per_step:2 * per_step]] if steps > 1 else []
    # launches a step: every kernel (and memcpy/memset) the step put on the GPU, graphs included
    return {"gpu_ms": sum(per_kernel.values()), "launches_per_step": launches_total / steps,
            "kernels": dict(ranked[:top]), "top_kernel_launches_us": launches}


def overlap_phases(llm: LLM, steps: int) -> dict:
    """Where an *overlapped* step's wall time goes: host ms per step in each phase of ``LLM.step`` (take,
    sampling; queueing the next step; waiting for this step's tokens; postprocess),
    the GPU's busy ms per step (union of kernel intervals, torch.profiler) and how many steps were queued
    ahead, the register kills and the preemptions in the window. A wait that grows while GPU ms stays at the serial
    forward's means the device idles on the host; GPU ms above the serial forward means extra device work."""
    from torch.profiler import ProfilerActivity, profile
    ra, runner, spent = llm.run_ahead, llm.runner, {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
            return out
        return wrapper

    patched = [(ra, "take"), (ra, "queue_next"), (runner, "sample"), (llm, "postprocess"), (ra, "read_back")]
    originals = [(obj, name, getattr(obj, name)) for obj, name in patched]
    for obj, name, fn in originals[:-1]:
        setattr(obj, name, timed(name, fn))
    read_back = timed("read_back", ra.read_back)
    ra.read_back = lambda *t: timed("wait", read_back(*t))
    before = (llm.stats.steps, llm.stats.queued_ahead, llm.stats.register_kills, llm.stats.preemptions)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    for obj, name, fn in originals:
        setattr(obj, name, fn)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, -math.inf
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    after = (llm.stats.steps, llm.stats.queued_ahead, llm.stats.register_kills, llm.stats.preemptions)
    d = [x - y for x, y in zip(after, before)]
    return {"wall_ms": 1e3 * wall / steps, "gpu_busy_ms": busy / 1e3 / steps,
            **{f"{k}_ms": 1e3 * v / steps for k, v in spent.items()},
            "queued_frac": d[1] / max(d[0], 1), "kills_per_step": d[2] / max(d[0], 1), "preemptions": d[3]}


def host_profile(llm: LLM, steps: int, top: int = 15) -> list[str]:
    """cProfile over ``steps`` overlapped steps: the functions with the most own (tottime) host time."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        llm.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [f"{1e3 * tt / steps:7.3f} ms/step own {1e3 * ct / steps:7.3f} cum  {Path(f).name}:{line} {name} x{nc / steps:.1f}"
            for (f, line, name), (cc, nc, tt, ct, _) in rows]


# Room left beside the KV pool on a card smaller than the rows' H200: the 1.7B weights (3.2 GiB), the CUDA graphs,
# the sampler's logits and the activations at batch <= 256, and the allocator's slack. A margin, not a measurement:
# a row that still runs out of memory says so in its log, and --kv-gb sets the pool by hand
ENGINE_OVERHEAD_GIB = 17


def kv_gb_for(total_bytes: int | None, ceiling: float) -> float:
    """The KV pool a benchmark asks for (GiB, as ``EngineArgs.kv_cache_gb``): ``ceiling`` — the H200 rows' size —
    or, on a card that cannot hold it beside the model (an H100: 79 GiB), its memory less ENGINE_OVERHEAD_GIB.
    ``total_bytes`` None (no GPU): ``ceiling``."""
    if total_bytes is None:
        return ceiling
    return min(ceiling, round(total_bytes / 2**30 - ENGINE_OVERHEAD_GIB, 1))


def card_kv_gb(ceiling: float) -> float:
    """``kv_gb_for`` this process's GPU 0."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return kv_gb_for(total, ceiling)


def live_tokens(spec: str, position: int) -> int:
    kind, *a = spec.split(":")
    if kind == "full":
        return position
    if kind == "registers":
        return PROMPT + int(a[0]) * STEP_TOKENS
    if kind == "h2o":
        return int(a[0])
    w = int(a[-1])
    return {"prefix_sliding": PROMPT, "streaming": int(a[0]), "sliding_window": 0}[kind] + w


def byte_limit(weight_bytes: float, kv_bytes: float, batch: int, bandwidth: float) -> float:
    """The tok/s a decode step's reads allow: every step reads the weights once and each row's live KV, at the
    card's measured copy bandwidth (bytes/s): ``batch`` tokens per (weights + KV) / bandwidth seconds."""
    return batch * bandwidth / (weight_bytes + kv_bytes)


def bench_engine(path: Path, spec: str, position: int, steps: int, kv_gb: float, max_seqs: int,
                 profile_steps: int = 0, gemv: bool = False, warmup: int = 8, sync_steps: int = 0,
                 phase_steps: int = 0, host_steps: int = 0, pdl: bool = False, bandwidth: float | None = None) -> dict:
    per_token = 2 * 28 * 8 * 128 * 2
    n = max(1, min(max_seqs, int(kv_gb * 2**30 / (per_token * (live_tokens(spec, position) + 64 + steps)))))
    llm = LLM(str(path), kv=spec, device="cuda", dtype="bfloat16", block_size=16, max_num_seqs=n,
              kv_cache_gb=kv_gb, max_model_len=position + 4096, overlap=True,  # registers' too (rollout.run_ahead)
              gemv=gemv, pdl=pdl)
    for k, v in zip(llm.runner.cache.k, llm.runner.cache.v):  # random K/V, never zeros
        k.normal_()
        v.normal_()
    place(llm, n, position, steps + 18 + profile_steps + sync_steps + phase_steps + host_steps)
    if llm.policy.kind == "registers":
        inject_registers(llm, position)
    rate, split = decode_rate(llm, steps, warmup)
    seqs = llm.scheduler.running
    row = {"policy": spec, "position": position, "batch": n, "gemv": gemv, "pdl": pdl, "tokens_per_s": rate,
           "live_kv_tokens_per_seq": sum(s.tracker.visible for s in seqs) / len(seqs),
           "kills_per_step": llm.stats.register_kills / llm.stats.steps,
           "queued_ahead_frac": llm.stats.queued_ahead / llm.stats.steps, "preemptions": llm.stats.preemptions, "timed_steps": split}
    if bandwidth:  # the step's bytes: the weights once (a tied head is one tensor) and every row's live KV
        weights = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
        kv = per_token * sum(s.tracker.visible for s in seqs)
        row["byte_limit_tok_s"] = byte_limit(weights, kv, n, bandwidth)
        row["of_byte_limit"] = rate / row["byte_limit_tok_s"]
    if phase_steps:  # overlapped steps first: step_breakdown below turns overlap off for a few steps
        row["overlap_phases"] = overlap_phases(llm, phase_steps)
    if host_steps:
        row["host_profile"] = host_profile(llm, host_steps)
    row.update(step_breakdown(llm, 8))
    if sync_steps:
        row["sync_sites"] = sync_sites(llm, sync_steps)
    if profile_steps:
        row["profile"] = kernel_profile(llm, profile_steps)
    llm.close()  # the pool, weights and CUDA graphs go before the next row's engine is built
    return row


def bench_transformers(path: Path, prompt_len: int, batch: int, new: int) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.full((batch, prompt_len), 65, device="cuda")
    kw = dict(do_sample=False, min_new_tokens=new, max_new_tokens=new, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, **{**kw, "min_new_tokens": 2, "max_new_tokens": 2})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **{**kw, "min_new_tokens": 1, "max_new_tokens": 1})
        torch.cuda.synchronize()
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return {"policy": "transformers generate (full)", "position": prompt_len, "batch": batch,
            "tokens_per_s": batch * (new - 1) / max(total - t_prefill, 1e-9), "live_kv_tokens_per_seq": prompt_len}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--policies", nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=48, help="decode steps, the warm-up included")
    parser.add_argument("--warmup", type=int, default=8,
                        help="untimed first steps")
    parser.add_argument("--kv-gb", type=float, default=None,
                        help="KV pool in GiB; default 100 (the H200 rows), or what a smaller card holds (kv_gb_for)")
    parser.add_argument("--max-seqs", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also report GPU ms per step by kernel over this many steps (torch.profiler)")
    parser.add_argument("--gemv", nargs="+", choices=["on", "off"], default=["off"],
                        help="linears over <= 8 tokens on the Triton GEMV (on) or cuBLAS (off); "
                             "'--gemv on off': a row for each")
    parser.add_argument("--pdl", nargs="+", choices=["on", "off"], default=["off"],
                        help="the decode step's Triton kernels as a programmatic-dependent-launch chain (on; "
                             "Hopper) or launched one after the other (off); '--pdl off on': a row for each")
    parser.add_argument("--sync-debug", type=int, default=0, metavar="STEPS",
                        help="also run this many steps under torch.cuda.set_sync_debug_mode and report where the "
                             "host waited for the device (file:line, count)")
    parser.add_argument("--phases", type=int, default=0, metavar="STEPS",
                        help="also time this many overlapped steps by phase (host ms per phase, GPU busy ms, "
                             "queued/killing/preempted counts)")
    parser.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                        help="also cProfile this many overlapped steps: host functions by own time")
    parser.add_argument("--step-tokens", type=int, default=STEP_TOKENS, metavar="N",
                        help="registers: a register (a kill, once every register holds a step) every N tokens; "
                             "the trained TIP model's cadence is 14 (benchmarks/register_cadence.py), which at "
                             "equal live KV (4,096) means registers:292")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.step_tokens < 2:
        parser.error(f"--step-tokens {args.step_tokens}: a step needs its register and at least one more token")
    globals()["STEP_TOKENS"] = args.step_tokens
    if args.kv_gb is None:
        args.kv_gb = card_kv_gb(100.0)
    w = args.window
    policies = args.policies or ["full", f"prefix_sliding:{w}", f"sliding_window:{w}", "registers:16"]
    from benchmarks.kernel_decode import copy_bandwidth

    bandwidth = copy_bandwidth()  # bytes/s, read + write counted: the byte limit's denominator
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "qwen3-1.7b-random")
        for position in args.positions:
            for spec in policies:
                for gemv, pdl in itertools.product(args.gemv, args.pdl):
                    rows.append(bench_engine(path, spec, position, args.steps, args.kv_gb, args.max_seqs,
                                             args.profile, gemv == "on", args.warmup, args.sync_debug,
                                             args.phases, args.host_profile, pdl == "on", bandwidth))
                    if spec.startswith("registers"):
                        rows[-1]["step_tokens"] = STEP_TOKENS
                    print(json.dumps(rows[-1]), flush=True)
        if args.hf_batch:
            rows.append(bench_transformers(path, min(args.positions), args.hf_batch, 64))
            print(json.dumps(rows[-1]), flush=True)
    full = {(r["position"], r.get("gemv"), r.get("pdl")): r["tokens_per_s"] for r in rows if r["policy"] == "full"}
    print(f"\n{'policy':<30}{'position':>9}{'batch':>7}{'gemv':>6}{'pdl':>5}{'tok/s':>10}{'vs full':>9}"
          f"{'live KV/seq':>12}{'of limit':>10}")
    onoff = {True: "on", False: "off", None: "-"}
    for r in rows:  # transformers: vs the first engine setting
        base = full.get((r["position"], r.get("gemv", args.gemv[0] == "on"), r.get("pdl", args.pdl[0] == "on")))
        ratio = r["tokens_per_s"] / base if base else math.nan
        print(f"{r['policy']:<30}{r['position']:>9}{r['batch']:>7}{onoff[r.get('gemv')]:>6}{onoff[r.get('pdl')]:>5}"
              f"{r['tokens_per_s']:>10.0f}{ratio:>8.2f}x{r['live_kv_tokens_per_seq']:>12.0f}"
              f"{r.get('of_byte_limit', math.nan):>9.0%} ")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
