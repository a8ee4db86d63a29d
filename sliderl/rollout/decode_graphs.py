"""CUDA graphs for decode steps: one captured forward per (batch-size bucket, split count).

The split count of the attention kernel is a compile-time constant chosen from the batch and its
longest sequence (rounded up to a power of two), so a new (bucket, split) pair met mid-run costs a
Triton compile and a capture: ~5 s on the H200, measured inside a timed window of
``benchmarks/engine_gpu.py`` when a register kill's batch-1 redo (since removed) met a new width. Buckets of at
most ``SMALL`` rows (the tail of a generation, batch-1 latency) run at many split counts,
so every pair they can meet is captured when the graphs are built; larger buckets use one split at
most widths and are captured on first use. (One split count per small bucket, the longest
sequence's, was tried: the splits cover the static width, so a short row's tiles fall in a few
splits and a batch-1 forward ran ~2 ms slower.)
"""

from __future__ import annotations

import torch

from sliderl.kernels.metadata import AttentionMetadata, register_kills
from sliderl.rollout.paged_attention import PagedAttention

SMALL = 4  # buckets up to this many rows are captured at every split count up front
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture(forward, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``forward()`` run twice on a side stream (allocations and autotuning settle there), then captured into a
    graph in memory pool ``pool``; the graph and its output tensor, which each replay overwrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return graph, output


class DecodeGraphs:
    """The captured decode forwards of one ``ModelRunner`` (its model, cache, scale and scratch slot)."""

    def __init__(self, runner, max_num_seqs: int, max_blocks: int):
        self.runner = runner
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.max_blocks = max_blocks
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self.replays = 0  # decode steps run from a graph
        dev, n = runner.device, self.buckets[-1]
        self.static = {
            "ids": torch.zeros(n, dtype=torch.long, device=dev),
            "pos": torch.zeros(n, dtype=torch.long, device=dev),
            "query_start": torch.zeros(n + 1, dtype=torch.int32, device=dev),
            "query_pos": torch.zeros(n, dtype=torch.int32, device=dev),
            "slot_mapping": torch.full((n,), runner.scratch_slot, dtype=torch.int64, device=dev),
            "slot_death": torch.zeros(n, dtype=torch.int32, device=dev),
            "block_tables": torch.full((n, max_blocks), -1, dtype=torch.int32, device=dev),
            "block_index": torch.full((n, max_blocks), -1, dtype=torch.int32, device=dev),
            "num_live_blocks": torch.zeros(n, dtype=torch.int32, device=dev),
        }
        if runner.track_mass:  # h2o: each replay zeroes it, then every layer adds its page mass (decode kernel)
            self.static["mass"] = torch.zeros(n, max_blocks, dtype=torch.float32, device=dev)
        if runner.register_of is not None:  # registers: each replay derives its pending kills from these and the ids
            self.static["ranges"] = torch.zeros(n, runner.num_registers, 2, dtype=torch.int32, device=dev)
        for bucket in (b for b in self.buckets if b <= SMALL):
            for e in range(max(0, max_blocks - 1).bit_length() + 1):  # every rounded width up to max_blocks
                key = (bucket, self._splits(bucket, 1 << e))
                if key not in self.graphs:
                    self.graphs[key] = self._capture(*key)

    def fits(self, meta: AttentionMetadata) -> bool:
        return meta.num_seqs <= self.buckets[-1] and meta.max_live_blocks <= self.max_blocks

    def run(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
            ranges: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copy this step's tensors into the static buffers, replay; hidden states ``[S, hidden]``, and under h2o the
        step's page mass ``[S, max_live_blocks]`` (a copy: the next replay, queued before it is read, rewrites the
        buffer), else None. ``ranges``: registers' ``[S, N, 2]`` (``ModelRunner.prepare``)."""
        s, width = meta.num_seqs, meta.max_live_blocks
        bucket = next(b for b in self.buckets if b >= s)
        key = (bucket, self._splits(bucket, width))
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, st, hidden = self.graphs[key]
        self._fill(ids, pos, meta, bucket, ranges)
        graph.replay()
        self.replays += 1
        mass = st.get("mass")
        return hidden[:s], None if mass is None else mass[:s, :width].clone()

    def close(self) -> None:
        """Release the captured graphs (their memory pool), the static buffers and the runner they point to."""
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.static.clear()
        self.runner = self.pool = None

    def _splits(self, bucket: int, width: int) -> int:
        from sliderl.kernels.decode import decode_config
        cfg = self.runner.model.config
        rounded = 1 << max(0, width - 1).bit_length()  # fewer distinct graphs as sequences grow
        return decode_config(bucket, cfg.num_kv_heads, self.runner.block_size, rounded, cfg.head_dim,
                             self.runner.cache.k[0].dtype, self.runner.device).num_splits

    def _fill(self, ids, pos, meta: AttentionMetadata, bucket: int, ranges: torch.Tensor | None) -> None:
        st, s, w = self.static, meta.num_seqs, meta.max_live_blocks
        nb = True
        if "ranges" in st:
            if ranges is None:
                raise ValueError("a registers decode step needs its register ranges (ModelRunner.prepare)")
            st["ranges"][:s].copy_(ranges, non_blocking=nb)
        st["ids"][:s].copy_(ids, non_blocking=nb)
        st["pos"][:s].copy_(pos, non_blocking=nb)
        st["query_start"][:s + 1].copy_(meta.query_start, non_blocking=nb)
        st["query_start"][s + 1:bucket + 1].fill_(s)
        st["query_pos"][:s].copy_(meta.query_pos, non_blocking=nb)
        st["slot_mapping"][:s].copy_(meta.slot_mapping, non_blocking=nb)
        st["slot_mapping"][s:bucket].fill_(self.runner.scratch_slot)
        st["slot_death"][:s].copy_(meta.slot_death, non_blocking=nb)
        st["block_tables"][:s, :w].copy_(meta.block_tables, non_blocking=nb)
        st["block_index"][:s, :w].copy_(meta.block_index, non_blocking=nb)
        st["num_live_blocks"][:s].copy_(meta.num_live_blocks, non_blocking=nb)
        st["num_live_blocks"][s:bucket].zero_()

    @torch.inference_mode()
    def _capture(self, bucket: int, splits: int):
        """Warm up and capture one bucket's forward, under inference mode whoever calls it (``ModelRunner.allocate``
        does, outside any step): with grad enabled ``DecoderLM`` takes its unfused PyTorch norm/RoPE path, and a
        graph keeps whatever path it recorded."""
        from sliderl.kernels.decode import decode_config

        r, st = self.runner, self.static
        cfg = r.model.config
        config = decode_config(bucket, cfg.num_kv_heads, r.block_size, self.max_blocks, cfg.head_dim,
                               r.cache.k[0].dtype, r.device)
        config = type(config)(config.tile_n, splits, config.num_warps, config.num_stages)
        st["query_start"][:bucket + 1].zero_()  # no queries while warming up and capturing
        st["slot_mapping"][:bucket].fill_(r.scratch_slot)
        st["num_live_blocks"][:bucket].zero_()
        meta = AttentionMetadata(
            query_start=st["query_start"][:bucket + 1], query_pos=st["query_pos"][:bucket],
            slot_mapping=st["slot_mapping"][:bucket], slot_death=st["slot_death"][:bucket],
            block_tables=st["block_tables"][:bucket], block_index=st["block_index"][:bucket],
            num_live_blocks=st["num_live_blocks"][:bucket], max_query_len=1, max_live_blocks=self.max_blocks)
        mass = st["mass"][:bucket] if "mass" in st else None
        attn = PagedAttention(r.cache, meta, r.scale, r.impl, decode_config=config, mass=mass,
                              pdl=r.model.pdl_kernels)

        def forward():
            if mass is not None:
                mass.zero_()
            if "ranges" in st:  # registers: this replay's pending kills, from its input tokens
                meta.kill = register_kills(st["ids"][:bucket], st["ranges"][:bucket], r.register_of,
                                           st["query_pos"][:bucket])
            return r.model(st["ids"][:bucket], st["pos"][:bucket], attn)

        graph, hidden = capture(forward, self.pool)
        return graph, st, hidden
