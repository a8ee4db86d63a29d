"""Planned Diffusion's denoising forwards padded to buckets, and on CUDA replayed as captured graphs.

A denoising forward's exact shape — R requests, S the most span tokens of one, L the longest cached prefix, N span
tokens in all — changes from step to step (spans finish, rounds start and end), so it is padded up to a bucket:
R to a power of two, S to a multiple of ``SPAN_MULTIPLE``, L to a multiple of ``PREFIX_MULTIPLE``, and the flat
token stream to R' * S' tokens (``SpanBatch.build``'s ``bucket``: pad queries see one key and are dropped, pad
prefix columns lie past every view, pad tokens are id 0 at position 0 and no query sees them). The logits at the
real masked rows are the exact forward's (tests/test_pd_attention.py).

On CUDA a bucket's forward is captured on its first use: its inputs in static buffers of the bucket's shape, the
attention mask computed inside the graph from them, hidden states ``[R' * S', hidden]`` out, in one private memory
pool that the buckets share (only one replays at a time, and its output is read before the next). A step copies
its inputs in and replays; the logits of the wanted rows are computed after the replay, eagerly (over all R' * S'
rows they would be large). At most ``MAX_GRAPHS`` buckets stay captured: using one more drops the least recently
used. On CPU the padded forward runs eagerly: the same padding, which the CPU tests check.

Commit forwards (which write the spans' K/V into the pool, once a round) stay eager at their exact shape
(``PDRuntime._forward``), and ``cuda_graphs=False`` turns the buckets off for denoising forwards too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from sliderl.rollout.decode_graphs import capture
from sliderl.rollout.planned_diffusion.span_attention import SpanAttention, SpanBatch

SPAN_MULTIPLE = 32  # S, the most span tokens of a request, is padded up to a multiple of this
PREFIX_MULTIPLE = 256  # L, the longest cached prefix, is padded up to a multiple of this
MAX_GRAPHS = 16  # captured buckets kept; one more drops the least recently used

Bucket = tuple[int, int, int]  # (R', S', L')


def bucket_of(num_requests: int, width: int, longest: int) -> Bucket:
    """The bucket of a denoising forward over ``num_requests`` requests, ``width`` span tokens at most per request
    and ``longest`` cached positions at most per request."""
    return 1 << (num_requests - 1).bit_length(), _round_up(width, SPAN_MULTIPLE), _round_up(longest, PREFIX_MULTIPLE)


def _round_up(x: int, multiple: int) -> int:
    return -(-max(1, x) // multiple) * multiple


@dataclass
class SpanGraph:
    """One bucket's captured forward and the static tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    ids: Tensor  # [R' * S'] int64 token ids
    pos: Tensor  # [R' * S'] int64 RoPE positions
    batch: SpanBatch  # the layout, of the bucket's shape
    hidden: Tensor  # [R' * S', hidden] the forward's output


class SpanGraphs:
    """The denoising forwards of one ``ModelRunner`` (module docstring); ``capture``: replay captured graphs (on
    CUDA only), else run the padded forward eagerly. The runner's ``release`` drops the graphs with the KV pool
    they read (``close``); they are captured again over the new pool on their next use."""

    def __init__(self, runner, capture: bool = True):
        self.runner = runner
        self.capture = capture and runner.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: OrderedDict[Bucket, SpanGraph] = OrderedDict()  # least recently used first
        self.captures = 0  # buckets captured over the runner's life (a replay does not count)
        runner.mode_graphs.append(self)

    @torch.inference_mode()
    def logits(self, ids: list[int], pos: list[int], prefix_slots: list[list[int]], span_ids: list[list[int]],
               views: list[list[int]], rows: list[int]) -> Tensor:
        """Logits ``[len(rows), V]`` at ``rows`` of the flat stream of span tokens (``ids``, ``pos``: [N]); the
        layout arguments are ``SpanBatch.build``'s."""
        r = self.runner
        bucket = bucket_of(len(span_ids), max(len(s) for s in span_ids), max(len(p) for p in prefix_slots))
        pad = [0] * (bucket[0] * bucket[1] - len(ids))  # pad tokens: id 0 at position 0
        ids_in, pos_in = r.host_tensor(ids + pad, torch.long), r.host_tensor(list(pos) + pad, torch.long)
        batch = SpanBatch.build(prefix_slots, span_ids, views, torch.device("cpu"), bucket=bucket)
        if self.capture:
            hidden = self._replay(bucket, ids_in, pos_in, batch)
        else:
            dev = r.device
            hidden = r.model(ids_in.to(dev, non_blocking=True), pos_in.to(dev, non_blocking=True),
                             SpanAttention(r.cache, batch.to(dev), r.scale))
        index = r.host_tensor(rows, torch.long).to(hidden.device, non_blocking=True)
        return r.model.compute_logits(hidden[index])

    def close(self) -> None:
        """Drop the captured graphs (the KV pool they read is going); the next use of a bucket captures it again,
        in a new memory pool (the old one is freed once every graph in it is gone)."""
        for g in self.graphs.values():
            g.graph.reset()
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def _replay(self, bucket: Bucket, ids: Tensor, pos: Tensor, batch: SpanBatch) -> Tensor:
        """Copy the step's (host) inputs into the bucket's static tensors and replay its graph, capturing it first
        if need be; the static hidden states ``[R' * S', hidden]``."""
        g = self.graphs.get(bucket)
        if g is None:
            g = self.graphs[bucket] = self._capture(bucket)
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)[1].graph.reset()
        self.graphs.move_to_end(bucket)
        g.ids.copy_(ids, non_blocking=True)
        g.pos.copy_(pos, non_blocking=True)
        g.batch.copy_(batch)
        g.graph.replay()
        return g.hidden

    @torch.inference_mode()
    def _capture(self, bucket: Bucket) -> SpanGraph:
        """Warm up and capture one bucket's forward over all-pad inputs, under inference mode whoever calls it
        (with grad enabled ``DecoderLM`` takes its unfused PyTorch path, and a graph keeps the path it recorded)."""
        r, dev = self.runner, self.runner.device
        n = bucket[0] * bucket[1]
        ids, pos = torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.long, device=dev)
        batch = SpanBatch.build([[]], [[]], [[]], dev, bucket=bucket)  # every slot a pad

        def forward() -> Tensor:  # SpanAttention made inside the graph: the mask is recomputed at each replay
            return r.model(ids, pos, SpanAttention(r.cache, batch, r.scale))

        graph, hidden = capture(forward, self.pool)
        self.captures += 1
        return SpanGraph(graph, ids, pos, batch, hidden)
