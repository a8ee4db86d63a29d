"""Triton paged-attention kernels against a dense float64 softmax built from positions and deaths.

Each case lays random sequences into a paged pool with shuffled physical blocks. Every slot no query
of its sequence can see (dead, out of window, future, unused blocks) holds NaN, and the output buffer
starts as NaN: a NaN in the result means a kernel read a slot it must skip or left an element
unwritten. On CPU these run under ``TRITON_INTERPRET=1`` at small shapes; ``gpu`` tests repeat them
at the Qwen3-1.7B attention shape.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports triton

from sliderl import kernels
import sliderl.kernels.reference as reference
from sliderl.kernels.cache_write import write_kv
from sliderl.kernels.decode import DecodeConfig, choose_num_splits, decode_attention
from sliderl.kernels.metadata import AttentionMetadata, PagedKVCache
from sliderl.kernels.prefill import PrefillConfig, prefill_attention

NEVER = 2**31 - 1
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@dataclass
class Seq:
    """One sequence: positions ``0..len(death)-1`` are in the cache; the last ``num_queries`` are queries."""

    death: list[int]
    num_queries: int


@dataclass
class Case:
    cache: PagedKVCache
    meta: AttentionMetadata
    q: torch.Tensor  # [N, H_q, D]
    keys: list[torch.Tensor]  # per sequence [T, H_kv, D] in the cache dtype
    values: list[torch.Tensor]
    seqs: list[Seq]


# ---------------------------------------------------------------------------------------------
# Random sequences and their deaths


def prefix_sliding_deaths(length: int, prefix: int, window: int) -> list[int]:
    """d(k) = never inside the prefix, else k + window (a query sees ``window`` keys, itself included)."""
    return [NEVER if k < prefix else k + window for k in range(length)]


def kill_spans(death: list[int], gen: torch.Generator, spans: int) -> list[int]:
    """Registers-style: ``spans`` random runs of positions die together at a later position."""
    death = list(death)
    n = len(death)
    for _ in range(spans):
        a = int(torch.randint(0, max(1, n - 2), (1,), generator=gen))
        b = min(n, a + 1 + int(torch.randint(1, 12, (1,), generator=gen)))
        r = int(torch.randint(b, n + 1, (1,), generator=gen))  # r >= b > every killed k
        for k in range(a, b):
            death[k] = min(death[k], r)
    return death


def random_seq(gen: torch.Generator, length: int, num_queries: int, window: int, prefix: int, spans: int) -> Seq:
    return Seq(kill_spans(prefix_sliding_deaths(length, prefix, window), gen, spans), num_queries)


# ---------------------------------------------------------------------------------------------
# Building a paged case


def seen_by_any_query(seq: Seq) -> list[bool]:
    """Whether some query q of the step sees k (``k <= q < d(k)``), per position k.

    The queries are the contiguous positions ``first..last``, so some q qualifies exactly when
    the smallest candidate ``max(k, first)`` is ``<= last`` and ``< d(k)``.
    """
    last = len(seq.death) - 1
    first = last + 1 - seq.num_queries
    return [max(k, first) <= last and max(k, first) < d for k, d in enumerate(seq.death)]


def build_case(seqs: list[Seq], block_size: int, num_kv_heads: int, group: int, head_dim: int,
               dtype: torch.dtype, gen: torch.Generator, keep_dead: float = 0.3, spare_blocks: int = 3,
               device: str = DEVICE) -> Case:
    """Lay ``seqs`` into a shuffled pool. Blocks nobody sees are left out of the tables, except a
    fraction ``keep_dead`` that stays listed (the kernels must mask them). Unseen slots hold NaN."""
    logical = [math.ceil(len(s.death) / block_size) for s in seqs]
    num_blocks = sum(logical) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_pool = torch.full(shape, float("nan"), dtype=dtype)
    v_pool = torch.full(shape, float("nan"), dtype=dtype)
    death_pool = torch.randint(-2**31, 2**31 - 1, (num_blocks, block_size), generator=gen, dtype=torch.int64).to(torch.int32)
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    tables, indices, keys, values = [], [], [], []
    for s, n_blocks in zip(seqs, logical):
        n = len(s.death)
        keys.append(torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype))
        values.append(torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype))
        seen = torch.tensor(seen_by_any_query(s))
        table, index = [], []
        for i in range(n_blocks):
            b = physical.pop()
            lo, hi = i * block_size, min(n, (i + 1) * block_size)
            death_pool[b, : hi - lo] = torch.tensor(s.death[lo:hi], dtype=torch.int32)
            used = seen[lo:hi]
            k_pool[b, : hi - lo][used] = keys[-1][lo:hi][used]
            v_pool[b, : hi - lo][used] = values[-1][lo:hi][used]
            if used.any() or float(torch.rand((), generator=gen)) < keep_dead:
                table.append(b)
                index.append(i)
        tables.append(table)
        indices.append(index)
    meta = make_metadata(seqs, tables, indices)
    n_tokens = sum(s.num_queries for s in seqs)
    q = torch.randn((n_tokens, num_kv_heads * group, head_dim), generator=gen).to(dtype)
    cache = PagedKVCache([k_pool.to(device)], [v_pool.to(device)], death_pool.to(device))
    return Case(cache, meta.to(device), q.to(device), keys, values, seqs)


def make_metadata(seqs: list[Seq], tables: list[list[int]], indices: list[list[int]]) -> AttentionMetadata:
    width = max(1, max(len(t) for t in tables))
    pad = lambda rows: [r + [-1] * (width - len(r)) for r in rows]  # noqa: E731
    starts, pos = [0], []
    for s in seqs:
        starts.append(starts[-1] + s.num_queries)
        pos.extend(range(len(s.death) - s.num_queries, len(s.death)))
    n = starts[-1]
    return AttentionMetadata(
        query_start=torch.tensor(starts, dtype=torch.int32),
        query_pos=torch.tensor(pos, dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64),  # attention ignores it
        slot_death=torch.zeros(n, dtype=torch.int32),
        block_tables=torch.tensor(pad(tables), dtype=torch.int32),
        block_index=torch.tensor(pad(indices), dtype=torch.int32),
        num_live_blocks=torch.tensor([len(t) for t in tables], dtype=torch.int32),
        max_query_len=max(s.num_queries for s in seqs),
        max_live_blocks=max(len(t) for t in tables),
    )


# ---------------------------------------------------------------------------------------------
# The independent reference and the checks


def dense_reference(case: Case, scale: float) -> torch.Tensor:
    """Float64 softmax of each query over the keys it sees (``k <= q < d(k)``); ``[N, H_q, D]``."""
    q = case.q.double().cpu()
    out = torch.zeros_like(q)
    group = q.shape[1] // case.keys[0].shape[1]
    row = 0
    for s, k, v in zip(case.seqs, case.keys, case.values):
        n = len(s.death)
        keys = torch.arange(n)
        queries = torch.arange(n - s.num_queries, n)
        seen = (keys[None, :] <= queries[:, None]) & (queries[:, None] < torch.tensor(s.death)[None, :])  # [nq, T]
        k = k.double().repeat_interleave(group, dim=1)  # [T, H_q, D]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->qhk", q[row:row + s.num_queries], k) * scale
        probs = scores.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
        out[row:row + s.num_queries] = torch.einsum("qhk,khd->qhd", probs, v)
        row += s.num_queries
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    out = out.double().cpu()
    assert not torch.isnan(out).any(), "NaN in the output: an unseen slot was read or an element left unwritten"
    err = float((out - ref).norm() / ref.norm())
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]:.0e}"


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


# ---------------------------------------------------------------------------------------------
# Decode


DECODE_CASES = [
    # block, group, dtype, splits, tile_n
    (4, 1, torch.float32, 1, 16),
    (4, 2, torch.bfloat16, 3, 16),
    (8, 4, torch.float32, 5, 32),
    (16, 2, torch.float32, 2, 16),
    (16, 4, torch.bfloat16, 1, 32),
    (32, 2, torch.bfloat16, 4, 16),  # a tile covers half a block
]


@pytest.mark.parametrize("block_size,group,dtype,splits,tile_n", DECODE_CASES)
def test_decode_matches_dense_reference(block_size, group, dtype, splits, tile_n):
    gen = torch.Generator().manual_seed(1000 * block_size + 10 * group + splits)
    seqs = [
        random_seq(gen, 45, 1, window=13, prefix=5, spans=3),  # window not a multiple of the block
        random_seq(gen, 3, 1, window=2, prefix=0, spans=0),  # a single block
        random_seq(gen, 70, 1, window=29, prefix=9, spans=6),  # dead spans between the prefix and window
        random_seq(gen, 22, 1, window=1000, prefix=0, spans=0),  # everything visible
        random_seq(gen, 61, 1, window=7, prefix=0, spans=2),  # pure sliding window
    ]
    case = build_case(seqs, block_size, num_kv_heads=2, group=group, head_dim=32, dtype=dtype, gen=gen)
    scale = 1 / math.sqrt(32)
    out = decode_attention(case.q, case.cache, 0, case.meta, scale,
                           config=DecodeConfig(tile_n=tile_n, num_splits=splits, num_warps=4, num_stages=2),
                           out=poisoned_like(case.q))
    assert_close(out, dense_reference(case, scale), dtype)


def test_decode_default_config_and_dispatch():
    """``kernels.paged_attention`` picks the decode kernel and runs it with the default launch shape."""
    gen = torch.Generator().manual_seed(7)
    seqs = [random_seq(gen, 90, 1, window=31, prefix=3, spans=2) for _ in range(2)]
    case = build_case(seqs, 8, num_kv_heads=1, group=2, head_dim=16, dtype=torch.float32, gen=gen)
    out = kernels.paged_attention(case.q, case.cache, 0, case.meta, 0.25, out=poisoned_like(case.q))
    assert_close(out, dense_reference(case, 0.25), torch.float32)


def test_decode_with_more_splits_than_tiles_and_an_empty_sequence():
    """Splits with no tile write an empty partial; a sequence with no live block gets 0 (no visible key)."""
    gen = torch.Generator().manual_seed(3)
    seqs = [random_seq(gen, 9, 1, window=5, prefix=1, spans=0), random_seq(gen, 30, 1, window=9, prefix=0, spans=1)]
    case = build_case(seqs, 4, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32, gen=gen, keep_dead=0.0)
    case.meta.num_live_blocks[1] = 0  # as if every block of sequence 1 were gone
    out = decode_attention(case.q, case.cache, 0, case.meta, 0.3,
                           config=DecodeConfig(tile_n=16, num_splits=6, num_warps=4, num_stages=2),
                           out=poisoned_like(case.q))
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))
    ref = dense_reference(case, 0.3)
    assert_close(out[:1], ref[:1], torch.float32)


def test_group_and_head_dim_not_powers_of_two():
    """Group 3 (e.g. 24 query / 8 KV heads) and head dim 24 are padded inside both kernels."""
    gen = torch.Generator().manual_seed(17)
    seqs = [random_seq(gen, 33, 1, window=10, prefix=2, spans=2), random_seq(gen, 20, 1, window=6, prefix=0, spans=0)]
    case = build_case(seqs, 8, num_kv_heads=2, group=3, head_dim=24, dtype=torch.float32, gen=gen)
    decoded = decode_attention(case.q, case.cache, 0, case.meta, 0.2,
                               config=DecodeConfig(tile_n=16, num_splits=2, num_warps=4, num_stages=2),
                               out=poisoned_like(case.q))
    assert_close(decoded, dense_reference(case, 0.2), torch.float32)
    seqs = [random_seq(gen, 30, 9, window=10, prefix=2, spans=2), random_seq(gen, 20, 1, window=6, prefix=0, spans=0)]
    case = build_case(seqs, 8, num_kv_heads=2, group=3, head_dim=24, dtype=torch.float32, gen=gen)
    prefilled = prefill_attention(case.q, case.cache, 0, case.meta, 0.2, out=poisoned_like(case.q))
    assert_close(prefilled, dense_reference(case, 0.2), torch.float32)


def test_choose_num_splits_fills_whole_waves():
    # 132 SMs x 2 programs = 264 slots.
    # 16 seqs x 8 KV heads = 128 programs: 1 split fills 128/264 = 0.48 of a wave, 2 splits 256/264 = 0.97.
    assert choose_num_splits(128, max_tiles=66, sms=132) == 2
    # 8 programs (batch 1): 33 splits fill 264/264 exactly; the smallest within 90% of that is 30
    # (240/264 = 0.909; 29 gives 232/264 = 0.879).
    assert choose_num_splits(8, max_tiles=66, sms=132) == 30
    # ... but never fewer than 2 tiles per split: 10 tiles allow at most 5 splits.
    assert choose_num_splits(8, max_tiles=10, sms=132) == 5
    # 256 seqs x 8 heads = 2048 programs already fill many waves.
    assert choose_num_splits(2048, max_tiles=66, sms=132) == 1


# ---------------------------------------------------------------------------------------------
# Prefill


PREFILL_CASES = [
    # block, group, dtype, block_q, tile_n
    (4, 1, torch.float32, 16, 16),
    (8, 2, torch.bfloat16, 8, 32),
    (16, 4, torch.float32, 8, 16),
    (16, 2, torch.bfloat16, 16, 16),
    (32, 4, torch.bfloat16, 4, 16),  # a tile covers half a block; 16 rows
]


@pytest.mark.parametrize("block_size,group,dtype,block_q,tile_n", PREFILL_CASES)
def test_prefill_matches_dense_reference(block_size, group, dtype, block_q, tile_n):
    gen = torch.Generator().manual_seed(2000 * block_size + 10 * group + block_q)
    seqs = [
        random_seq(gen, 29, 29, window=11, prefix=6, spans=2),  # a whole prompt, window inside it
        random_seq(gen, 54, 13, window=13, prefix=4, spans=4),  # a chunk after 41 cached tokens
        random_seq(gen, 50, 1, window=17, prefix=2, spans=1),  # a decode token in the same batch
        random_seq(gen, 5, 5, window=3, prefix=0, spans=0),  # a single block
    ]
    case = build_case(seqs, block_size, num_kv_heads=2, group=group, head_dim=32, dtype=dtype, gen=gen)
    scale = 1 / math.sqrt(32)
    out = prefill_attention(case.q, case.cache, 0, case.meta, scale,
                            config=PrefillConfig(block_q=block_q, tile_n=tile_n, num_warps=4, num_stages=2),
                            out=poisoned_like(case.q))
    assert_close(out, dense_reference(case, scale), dtype)


def test_paged_attention_matches_torch_reference():
    """The dispatcher (prefill kernel here) and ``kernels.reference`` (float64) on a finite cache."""
    gen = torch.Generator().manual_seed(11)
    seqs = [random_seq(gen, 40, 12, window=9, prefix=3, spans=2), random_seq(gen, 21, 1, window=6, prefix=2, spans=0)]
    case = build_case(seqs, 8, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32, gen=gen)
    for pool in (case.cache.k[0], case.cache.v[0]):
        pool.nan_to_num_(0.0)  # the torch reference multiplies p = 0 by every listed slot
    out = kernels.paged_attention(case.q, case.cache, 0, case.meta, 0.25, out=poisoned_like(case.q))
    cache64 = PagedKVCache([case.cache.k[0].double()], [case.cache.v[0].double()], case.cache.death)
    ref = reference.paged_attention(case.q.double(), cache64, 0, case.meta, 0.25, acc_dtype=torch.float64)
    assert_close(out, ref.cpu(), torch.float32)


# ---------------------------------------------------------------------------------------------
# Cache write


def test_write_kv_stores_slots_and_layer0_deaths():
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, h_kv, dim = 6, 4, 3, 16
    cache = PagedKVCache.allocate(2, num_blocks, block_size, h_kv, dim, torch.bfloat16, DEVICE)
    slots = torch.tensor([5, 0, 23, -1, 17], dtype=torch.int64)  # -1: a padding token, skipped
    deaths = torch.tensor([9, NEVER, 40, 77, 30], dtype=torch.int32)
    meta = make_metadata([Seq([NEVER], 1)], [[0]], [[0]])
    meta.slot_mapping, meta.slot_death = slots, deaths
    meta = meta.to(DEVICE)
    k = torch.randn((5, h_kv, dim), generator=gen).to(DEVICE)  # fp32 in, cast to the bf16 cache
    v = torch.randn((5, h_kv, dim), generator=gen).to(DEVICE)
    for layer in (0, 1):
        write_kv(cache, layer, k, v, meta)
    for layer in (0, 1):
        flat_k = cache.k[layer].view(-1, h_kv, dim).cpu()
        flat_v = cache.v[layer].view(-1, h_kv, dim).cpu()
        for n, slot in enumerate(slots.tolist()):
            if slot >= 0:  # slot 23 = block 5, offset 3
                assert torch.equal(flat_k[slot], k[n].cpu().to(torch.bfloat16))
                assert torch.equal(flat_v[slot], v[n].cpu().to(torch.bfloat16))
        written = [s for s in slots.tolist() if s >= 0]
        untouched = [s for s in range(num_blocks * block_size) if s not in written]
        assert not flat_k[untouched].any() and not flat_v[untouched].any()
    expected = torch.zeros(num_blocks * block_size, dtype=torch.int32)
    expected[[5, 0, 23, 17]] = torch.tensor([9, NEVER, 40, 30], dtype=torch.int32)  # written once, by layer 0
    assert torch.equal(cache.death.view(-1).cpu(), expected)


def test_write_then_attend_through_dispatch():
    """A prompt written by ``kernels.write_kv`` then read by ``kernels.paged_attention``: causal softmax."""
    gen = torch.Generator().manual_seed(9)
    n, h_kv, group, dim, block_size = 11, 1, 2, 16, 4
    cache = PagedKVCache.allocate(1, 5, block_size, h_kv, dim, torch.float32, DEVICE)
    blocks = [3, 0, 4]  # logical block i -> physical blocks[i]
    meta = make_metadata([Seq([NEVER] * n, n)], [blocks], [[0, 1, 2]])
    meta.slot_mapping = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)])
    meta.slot_death = torch.full((n,), NEVER, dtype=torch.int32)
    meta = meta.to(DEVICE)
    k, v, q = (torch.randn((n, h, dim), generator=gen).to(DEVICE) for h in (h_kv, h_kv, h_kv * group))
    kernels.write_kv(cache, 0, k, v, meta)
    out = kernels.paged_attention(q, cache, 0, meta, 0.5).double().cpu()
    scores = torch.einsum("qhd,khd->hqk", q.double().cpu(), k.double().cpu().repeat_interleave(group, 1)) * 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double().cpu().repeat_interleave(group, 1))
    assert_close(out, ref, torch.float32)


# ---------------------------------------------------------------------------------------------
# Launch checks


def small_case(dtype=torch.float32) -> Case:
    gen = torch.Generator().manual_seed(1)
    return build_case([random_seq(gen, 10, 1, window=4, prefix=1, spans=0)], 4, 2, 2, 16, dtype, gen)


def test_launchers_reject_bad_arguments():
    case = small_case()
    with pytest.raises(ValueError, match="q dtype"):
        kernels.paged_attention(case.q.to(torch.bfloat16), case.cache, 0, case.meta, 1.0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kernels.paged_attention(case.q[:, :3].contiguous(), case.cache, 0, case.meta, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        q = torch.empty(case.q.shape[::-1], device=case.q.device).transpose(0, 2)
        kernels.paged_attention(q, case.cache, 0, case.meta, 1.0)
    with pytest.raises(ValueError, match="layer 1 out of range"):
        kernels.paged_attention(case.q, case.cache, 1, case.meta, 1.0)
    bad = AttentionMetadata(**{**vars(case.meta), "block_tables": case.meta.block_tables.long()})
    with pytest.raises(ValueError, match="block_tables must be int32"):
        kernels.paged_attention(case.q, case.cache, 0, bad, 1.0)
    chunk = AttentionMetadata(**{**vars(case.meta), "max_query_len": 2})
    with pytest.raises(ValueError, match="one query per sequence"):
        decode_attention(case.q, case.cache, 0, chunk, 1.0)
    with pytest.raises(ValueError, match="tile_n"):
        decode_attention(case.q, case.cache, 0, case.meta, 1.0, config=DecodeConfig(24, 1, 4, 2))
    with pytest.raises(ValueError, match="out must match q"):
        kernels.paged_attention(case.q, case.cache, 0, case.meta, 1.0, out=case.q[:, :1])
    with pytest.raises(ValueError, match="must be \\[N, 2, 16\\]"):
        write_kv(case.cache, 0, case.q, case.q, case.meta)


# ---------------------------------------------------------------------------------------------
# GPU: the Qwen3-1.7B attention shape (16 query heads, 8 KV heads, head dim 128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 16])
def test_decode_full_shape(dtype, batch):
    gen = torch.Generator().manual_seed(batch)
    seqs = [random_seq(gen, 6000 + 37 * i, 1, window=4096, prefix=100, spans=20) for i in range(batch)]
    case = build_case(seqs, 16, num_kv_heads=8, group=2, head_dim=128, dtype=dtype, gen=gen, keep_dead=0.05)
    out = kernels.paged_attention(case.q, case.cache, 0, case.meta, 128 ** -0.5, out=poisoned_like(case.q))
    assert_close(out, dense_reference(case, 128 ** -0.5), dtype)
    for splits in (1, 7):
        cfg = DecodeConfig(tile_n=64 if dtype == torch.bfloat16 else 32, num_splits=splits, num_warps=4, num_stages=3)
        out = decode_attention(case.q, case.cache, 0, case.meta, 128 ** -0.5, config=cfg, out=poisoned_like(case.q))
        assert_close(out, dense_reference(case, 128 ** -0.5), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_full_shape(dtype):
    gen = torch.Generator().manual_seed(21)
    seqs = [random_seq(gen, 700, 700, window=256, prefix=40, spans=8),
            random_seq(gen, 1500, 300, window=512, prefix=100, spans=10),
            random_seq(gen, 900, 1, window=300, prefix=10, spans=3)]
    case = build_case(seqs, 16, num_kv_heads=8, group=2, head_dim=128, dtype=dtype, gen=gen)
    out = kernels.paged_attention(case.q, case.cache, 0, case.meta, 128 ** -0.5, out=poisoned_like(case.q))
    assert_close(out, dense_reference(case, 128 ** -0.5), dtype)


@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph():
    """Captured once, replayed after the metadata and queries change in place (the engine's decode path)."""
    gen = torch.Generator().manual_seed(8)
    cases = [build_case([random_seq(gen, 3000, 1, window=1024, prefix=50, spans=5) for _ in range(4)],
                        16, num_kv_heads=8, group=2, head_dim=128, dtype=torch.bfloat16, gen=gen) for _ in range(2)]
    width = max(c.meta.block_tables.shape[1] for c in cases)
    for c in cases:  # same table width so one set of static buffers serves both
        pad = torch.full((4, width - c.meta.block_tables.shape[1]), -1, dtype=torch.int32, device="cuda")
        c.meta.block_tables = torch.cat([c.meta.block_tables, pad], 1)
        c.meta.block_index = torch.cat([c.meta.block_index, pad], 1)
    static = cases[0]
    num_blocks = max(c.cache.num_blocks for c in cases)
    cache = PagedKVCache.allocate(1, num_blocks, 16, 8, 128, torch.bfloat16, "cuda")
    out = poisoned_like(static.q)
    cfg = DecodeConfig(tile_n=64, num_splits=3, num_warps=4, num_stages=3)
    decode_attention(static.q, cache, 0, static.meta, 0.1, config=cfg, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(static.q, cache, 0, static.meta, 0.1, config=cfg, out=out)
    for c in cases:
        for name in ("block_tables", "block_index", "num_live_blocks", "query_pos"):
            getattr(static.meta, name).copy_(getattr(c.meta, name))
        static.q.copy_(c.q)
        for dst, src in ((cache.k[0], c.cache.k[0]), (cache.v[0], c.cache.v[0]), (cache.death, c.cache.death)):
            dst[: src.shape[0]].copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        assert_close(out, dense_reference(c, 0.1), torch.bfloat16)


@pytest.mark.gpu
def test_decode_offsets_past_int32():
    """Live blocks at the top of a pool whose element offsets exceed 2**31 (int64 pointer math)."""
    block_size, h_kv, dim = 16, 8, 128
    num_blocks = 2**31 // (block_size * h_kv * dim) + 64  # 4.1 GB per bf16 pool
    cache = PagedKVCache.allocate(1, num_blocks, block_size, h_kv, dim, torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(4)
    n = 40 * block_size
    k = torch.randn((n, h_kv, dim), generator=gen).to(torch.bfloat16)
    v = torch.randn((n, h_kv, dim), generator=gen).to(torch.bfloat16)
    blocks = list(range(num_blocks - 40, num_blocks))
    meta = make_metadata([Seq([NEVER] * n, 1)], [blocks], [list(range(40))])
    meta.slot_mapping = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)])
    meta.slot_death = torch.full((n,), NEVER, dtype=torch.int32)
    kernels.write_kv(cache, 0, k.cuda(), v.cuda(), meta.to("cuda"))
    meta.slot_mapping, meta.slot_death = meta.slot_mapping[-1:], meta.slot_death[-1:]
    q = torch.randn((1, 2 * h_kv, dim), generator=gen).to(torch.bfloat16)
    out = kernels.paged_attention(q.cuda(), cache, 0, meta.to("cuda"), dim ** -0.5)
    case = Case(cache, meta, q, [k], [v], [Seq([NEVER] * n, 1)])
    assert_close(out, dense_reference(case, dim ** -0.5), torch.bfloat16)


@pytest.mark.parametrize("block_size,group", [(4, 1), (8, 2), (16, 4)])
def test_torch_reference_decode_batch_matches_dense_reference(block_size, group):
    """The CPU engine's batched decode path of ``kernels.reference`` against the float64 dense reference.

    Catches: a padded table entry (-1) read as a real block, a listed dead block or an unseen (NaN)
    slot leaking into the sum, the GQA head mapping, a sequence without live blocks not giving 0.
    Checked by planting: dropping the ``live`` mask, or ``v.masked_fill``, or using ``h % H_kv`` for
    the KV head makes this fail.
    """
    gen = torch.Generator().manual_seed(77 + block_size + group)
    seqs = [random_seq(gen, 45, 1, window=13, prefix=5, spans=3), random_seq(gen, 3, 1, window=2, prefix=0, spans=0),
            random_seq(gen, 70, 1, window=29, prefix=9, spans=6), random_seq(gen, 61, 1, window=7, prefix=0, spans=2),
            random_seq(gen, 9, 1, window=5, prefix=1, spans=0)]
    case = build_case(seqs, block_size, num_kv_heads=2, group=group, head_dim=16, dtype=torch.float32, gen=gen,
                      device="cpu")
    case.meta.num_live_blocks[4] = 0  # as if every block of sequence 4 were gone
    case.meta.block_tables[4] = -1
    assert case.meta.is_decode
    cache64 = PagedKVCache([case.cache.k[0].double()], [case.cache.v[0].double()], case.cache.death)
    out = reference.paged_attention(case.q.double(), cache64, 0, case.meta, 0.3, acc_dtype=torch.float64)
    ref = dense_reference(case, 0.3)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    torch.testing.assert_close(out[:4], ref[:4], rtol=1e-10, atol=1e-10)


def test_torch_reference_decode_recomputes_visibility_when_a_forward_starts_again():
    """The CPU decode keeps the step's visibility in ``meta.scratch`` for layers 1.. (layer 0 computes it).

    Catches: a mask served to a later forward on the same metadata after a death changed in between (CUDA-graph
    capture runs one metadata object several times; a register kill changes a death between steps). Checked by
    planting: reusing the kept mask at layer 0 too makes the second call see the killed key, and this fails.
    """
    gen = torch.Generator().manual_seed(5)
    seqs = [random_seq(gen, 40, 1, window=12, prefix=4, spans=2), random_seq(gen, 30, 1, window=9, prefix=2, spans=1)]
    case = build_case(seqs, 8, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32, gen=gen, device="cpu")
    cache64 = PagedKVCache([case.cache.k[0].double()], [case.cache.v[0].double()], case.cache.death)
    first = reference.paged_attention(case.q.double(), cache64, 0, case.meta, 0.3, acc_dtype=torch.float64)
    torch.testing.assert_close(first, dense_reference(case, 0.3), rtol=1e-10, atol=1e-10)
    # sequence 0's query (its last position q) sees its own key; kill that key at q, in the cache and the reference
    q = len(case.seqs[0].death) - 1
    column = case.meta.block_index[0].tolist().index(q // 8)
    case.cache.death[int(case.meta.block_tables[0, column]), q % 8] = q
    case.seqs[0].death[q] = q
    second = reference.paged_attention(case.q.double(), cache64, 0, case.meta, 0.3, acc_dtype=torch.float64)
    torch.testing.assert_close(second, dense_reference(case, 0.3), rtol=1e-10, atol=1e-10)
    assert not torch.allclose(second[0], first[0])


# ---------------------------------------------------------------------------------------------
# Paged H2O: per-page attention mass


def dense_page_mass(case: Case, scale: float) -> torch.Tensor:
    """Float64 ``[S, M]``: for each block-table column, the softmax probability (over the keys each query
    sees, ``k <= q < d(k)``) of that block's keys, summed over query heads and the sequence's queries."""
    q = case.q.double().cpu()
    tables, index = case.meta.block_index.cpu(), case.meta.num_live_blocks.cpu()
    bs = case.cache.block_size
    mass = torch.zeros(tables.shape, dtype=torch.float64)
    group = q.shape[1] // case.keys[0].shape[1]
    row = 0
    for s, (seq, k) in enumerate(zip(case.seqs, case.keys)):
        n = len(seq.death)
        keys, queries = torch.arange(n), torch.arange(n - seq.num_queries, n)
        seen = (keys[None, :] <= queries[:, None]) & (queries[:, None] < torch.tensor(seq.death)[None, :])
        scores = torch.einsum("qhd,khd->qhk", q[row:row + seq.num_queries], k.double().repeat_interleave(group, 1))
        probs = (scores * scale).masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)  # [nq, H_q, T]
        per_key = probs.sum((0, 1))  # [T]
        for c in range(int(index[s])):
            page = int(tables[s, c])
            mass[s, c] = per_key[page * bs:(page + 1) * bs].sum()
        row += seq.num_queries
    return mass


H2O_MASS_CASES = [(4, 1, 1, 16), (4, 2, 3, 16), (8, 4, 5, 32), (32, 2, 4, 16)]  # block, group, splits, tile_n


@pytest.mark.parametrize("block_size,group,splits,tile_n", H2O_MASS_CASES)
def test_h2o_page_mass_matches_dense_softmax_per_page(block_size, group, splits, tile_n):
    """The decode kernel's optional mass output (and the torch reference's) against a float64 dense softmax.

    Catches: a split's own max/sum used instead of the merged global normaliser (each split's keys
    then sum to ~1 per head, so a sequence's mass exceeds H_q); mass written to the wrong block-table
    column (logical index instead of column, or a tile spanning blocks credited to one); dead or
    unseen keys counted; the output overwritten instead of added to (layers accumulate into it); the
    mass of one query head per GQA group. Planted: each split storing its own normaliser, column =
    logical block, no visibility mask, store instead of atomic add, one head per group — each fails. The single
    pass (per-segment log2 sums rescaled after the merge): a segment's sum stored without its tile's max fails
    every case but one; only a column's first segment counted (32-key blocks over 16-key tiles) fails that case.
    """
    gen = torch.Generator().manual_seed(500 + 10 * block_size + splits)
    seqs = [random_seq(gen, 45, 1, window=13, prefix=5, spans=3), random_seq(gen, 70, 1, window=29, prefix=9, spans=6),
            random_seq(gen, 22, 1, window=1000, prefix=0, spans=0), random_seq(gen, 9, 1, window=5, prefix=1, spans=0)]
    case = build_case(seqs, block_size, num_kv_heads=2, group=group, head_dim=16, dtype=torch.float32, gen=gen)
    scale = 0.3
    ref = dense_page_mass(case, scale)
    h_q = case.q.shape[1]
    assert torch.allclose(ref.sum(1), torch.full((len(seqs),), float(h_q), dtype=torch.float64))  # probabilities
    start = torch.full(ref.shape, 0.5)  # the output adds to what the buffer holds
    mass = start.clone().to(DEVICE)
    out = decode_attention(case.q, case.cache, 0, case.meta, scale, out=poisoned_like(case.q), mass=mass,
                           config=DecodeConfig(tile_n=tile_n, num_splits=splits, num_warps=4, num_stages=2))
    assert_close(out, dense_reference(case, scale), torch.float32)  # the attention output is unchanged
    torch.testing.assert_close(mass.cpu().double() - 0.5, ref, rtol=1e-4, atol=1e-5)
    cpu = PagedKVCache([case.cache.k[0].cpu().double()], [case.cache.v[0].cpu().double()], case.cache.death.cpu())
    mass64 = start.double()
    reference.paged_attention(case.q.cpu().double(), cpu, 0, case.meta.to("cpu"), scale, torch.float64, mass=mass64)
    torch.testing.assert_close(mass64 - 0.5, ref, rtol=1e-10, atol=1e-10)


def test_h2o_page_mass_of_prefill_chunks_in_the_torch_reference():
    """Prefill rows (several queries per sequence) add every query's mass: what the CPU engine (and, for
    chunks, the CUDA engine under h2o) accumulates. Catches summing one query only or the wrong block."""
    gen = torch.Generator().manual_seed(21)
    seqs = [random_seq(gen, 30, 7, window=10, prefix=2, spans=2), random_seq(gen, 20, 1, window=6, prefix=0, spans=0),
            random_seq(gen, 41, 12, window=1000, prefix=0, spans=3)]
    case = build_case(seqs, 8, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32, gen=gen, device="cpu")
    cpu = PagedKVCache([case.cache.k[0].double()], [case.cache.v[0].double()], case.cache.death)
    mass = torch.zeros(case.meta.block_tables.shape, dtype=torch.float64)
    reference.paged_attention(case.q.double(), cpu, 0, case.meta, 0.3, torch.float64, mass=mass)
    torch.testing.assert_close(mass, dense_page_mass(case, 0.3), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# Registers: the pending kill of a decode step queued before its input token was read back

@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_a_pending_register_kill_hides_the_killed_step_from_its_query(impl):
    """``meta.kill`` (lo, hi) per sequence: keys lo <= k < hi are dead for the query although the cache's deaths still
    say they live (the host writes them one step later). The killed slots hold NaN and stay listed, so a kernel that
    sees any of them returns NaN. Catches the decode kernel (or the CPU engine's torch reference) ignoring the kill
    (planted: KILL dropped from the launch; NaN), an off-by-one at either end (planted: ``pos <= kill_hi``; the
    first slot after the step is lost), and one sequence's kill read for another (planted: ``kill_ptr + 0``)."""
    gen = torch.Generator().manual_seed(5)
    block = 8
    # (length, window, prefix, kill): the query is the last position; the last sequence has no kill, and the second's
    # kill ends where its window's visible keys go on
    specs = [(45, 1000, 0, (10, 17)), (70, 29, 9, (44, 60)), (30, 1000, 4, (4, 29)), (20, 1000, 0, (0, 0))]
    seqs, before = [], []
    for n, window, prefix, (lo, hi) in specs:
        death = prefix_sliding_deaths(n, prefix, window)
        before.append(list(death))
        for k in range(lo, hi):
            death[k] = min(death[k], n - 1)  # dead at the query: what the dense reference applies
        seqs.append(Seq(death, 1))
    case = build_case(seqs, block, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32, gen=gen, keep_dead=1.0)
    for s, (_, _, _, (lo, hi)) in enumerate(specs):  # the cache does not know the kill yet
        for col in range(int(case.meta.num_live_blocks[s])):
            b, i = int(case.meta.block_tables[s, col]), int(case.meta.block_index[s, col])
            for slot in range(block):
                if lo <= i * block + slot < hi:
                    case.cache.death[b, slot] = before[s][i * block + slot]
    case.meta.kill = torch.tensor([kill for *_, kill in specs], dtype=torch.int32, device=DEVICE)
    scale = 0.3
    if impl == "triton":
        out = decode_attention(case.q, case.cache, 0, case.meta, scale,
                               config=DecodeConfig(tile_n=16, num_splits=2, num_warps=4, num_stages=2),
                               out=poisoned_like(case.q))
    else:
        cpu = case.meta.to("cpu")
        cache = PagedKVCache([case.cache.k[0].cpu()], [case.cache.v[0].cpu()], case.cache.death.cpu())
        out = reference.paged_attention(case.q.cpu(), cache, 0, cpu, scale)
    assert_close(out, dense_reference(case, scale), torch.float32)


def test_register_kills_are_the_ranges_the_tracker_kills_at_that_token():
    """``register_kills`` from the host's ranges of positions < r and the token at r (on the device) against
    ``DeathTracker.append(r, token)``'s own killed range, over random register streams of 4 sequences at once:
    a re-emitted register of a closed step, of the growing step (its end is the query), a first use (no kill), the
    end-of-thinking token (closes, kills nothing) and plain tokens. Catches ranges followed wrong (planted: the
    growing step's end not set at its close) and a row served another row's ranges (planted: ranges[0] for every
    row), and the host's already-followed token counted as a kill (the range the engine sends for a step it did not
    queue ahead must be empty)."""
    from sliderl.core.kv_policy import KVPolicy
    from sliderl.kernels.metadata import register_kills

    regs, end_think, vocab = [50, 51, 52], 60, 64
    policy = KVPolicy.parse("registers:3").bind(regs, end_think)
    register_of = torch.full((vocab,), -1, dtype=torch.int32)
    register_of[regs] = torch.arange(3, dtype=torch.int32)
    gen = torch.Generator().manual_seed(11)
    prompt = 5
    trackers = [policy.tracker(prompt) for _ in range(4)]
    for t in trackers:
        for p in range(prompt):
            t.append(p, 7)
    killed_seen = 0
    for r in range(prompt, prompt + 300):
        draw = torch.randint(0, 10, (4,), generator=gen).tolist()
        tokens = [regs[d % 3] if d < 4 else (end_think if d == 4 else 9) for d in draw]
        ranges = torch.tensor(np.stack([t.register_ranges for t in trackers]))
        kill = register_kills(torch.tensor(tokens), ranges, register_of, torch.full((4,), r, dtype=torch.int32))
        for s, (t, tok) in enumerate(zip(trackers, tokens)):
            killed = t.append(r, tok)
            lo, hi = kill[s].tolist()
            assert ((lo, hi) == killed[0]) if killed else lo >= hi, (r, s, tok, killed, (lo, hi))
            killed_seen += bool(killed)
        # a step the host did not queue ahead: its input token is already followed, so nothing more dies
        after = register_kills(torch.tensor(tokens), torch.tensor(np.stack([t.register_ranges for t in trackers])),
                               register_of, torch.full((4,), r, dtype=torch.int32))
        assert bool((after[:, 0] >= after[:, 1]).all())
    assert killed_seen > 100
