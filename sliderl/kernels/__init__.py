"""Paged attention over a bounded KV cache: the interface, a pure-torch path and the Triton kernels.

The package owns
- ``metadata``: ``AttentionMetadata`` (flat varlen batch, live block tables) and ``PagedKVCache``;
- ``reference``: pure-torch ``write_kv`` / ``paged_attention`` (the CPU path and the reference);
- the Triton kernels: ``cache_write`` (K/V + deaths into slots), ``decode`` (one query per
  sequence, split-K), ``prefill`` (varlen / chunked prefill), sharing ``key_tile`` and checked by
  ``launch_checks``;
- ``norm_rope``: fused RMSNorm (with the residual add) and q/k-norm + RoPE, the decoder's small ops
  on its inference path (``DecoderLM.fused_kernels``);
- ``gemv``: a split-K skinny GEMM for at most 16 rows (W read once), the decoder's linear layers
  and lm_head at small decode batches (``DecoderLM.gemv_kernels``).

``paged_attention`` and ``write_kv`` below dispatch to the kernels. Triton is imported only when they
are first called, so ``kernels.metadata`` and ``kernels.reference`` import without it, and
``TRITON_INTERPRET=1`` (CPU interpreter) can still be set beforehand.
"""

from __future__ import annotations

import torch

from sliderl.kernels.metadata import AttentionMetadata, PagedKVCache


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float,
                    out: torch.Tensor | None = None, mass: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q [N, H_q, D]`` over each sequence's live blocks with the Triton kernels; ``[N, H_q, D]``.

    Decode batches (``meta.is_decode``) use the split-K decode kernel, all others the prefill kernel.
    Same function as ``kernels.reference.paged_attention`` except that a query with no visible key
    gets 0 instead of NaN. ``out`` (like q) receives the result when given. ``mass`` (Paged H2O: per
    block-table column attention mass, ``kernels.reference``'s module docstring): decode batches get it
    from the decode kernel; the prefill kernel has no such output, so a batch with a prefill chunk
    then runs the pure-torch reference instead.
    """
    if mass is not None and not meta.is_decode:
        from sliderl.kernels.reference import paged_attention as torch_attention
        result = torch_attention(q, cache, layer, meta, scale, mass=mass)
        return result if out is None else out.copy_(result)
    if meta.is_decode:
        from sliderl.kernels.decode import decode_attention
        return decode_attention(q, cache, layer, meta, scale, out=out, mass=mass)
    if meta.kill is not None:
        raise ValueError("AttentionMetadata.kill is a decode step's (one query per sequence), got "
                         f"max_query_len={meta.max_query_len}")
    from sliderl.kernels.prefill import prefill_attention
    return prefill_attention(q, cache, layer, meta, scale, out=out)


def write_kv(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store new ``k, v [N, H_kv, D]`` at ``meta.slot_mapping`` with the Triton kernel; layer 0 also stores deaths."""
    from sliderl.kernels.cache_write import write_kv as write_kv_kernel
    write_kv_kernel(cache, layer, k, v, meta)


__all__ = ["AttentionMetadata", "PagedKVCache", "paged_attention", "write_kv"]
