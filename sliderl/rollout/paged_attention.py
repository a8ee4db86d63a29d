"""The model's attention backend during generation: write the new K/V into the paged cache, then
attend over each sequence's live blocks (Triton kernels on CUDA, the pure-torch reference elsewhere).

``ModelRunner`` builds one per eager forward, ``DecodeGraphs`` one per captured graph.
"""

from __future__ import annotations

import torch

import sliderl.kernels.reference as torch_attention
from sliderl.kernels.metadata import AttentionMetadata, PagedKVCache


class PagedAttention:
    """Attention over the paged KV cache for one forward; ``decode_config`` pins the decode kernel's launch.

    ``mass`` (h2o): a zeroed float32 ``[S, M]`` buffer that every layer adds its attention mass per
    block-table column to (``kernels.reference``'s module docstring). ``pdl``: launch the cache write and the
    decode kernel into the model's PDL chain (``kernels.pdl``; with ``decode_config``, on Hopper).
    """

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, scale: float, impl, decode_config=None,
                 mass: torch.Tensor | None = None, pdl: bool = False):
        self.cache, self.meta, self.scale, self.impl, self.decode_config = cache, meta, scale, impl, decode_config
        self.mass = mass
        if pdl and decode_config is None:
            raise ValueError("pdl chains the captured decode kernels: give a decode_config with it")
        self.pdl = pdl

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.decode_config is not None:
            from sliderl.kernels.cache_write import write_kv
            from sliderl.kernels.decode import decode_attention
            write_kv(self.cache, layer, k, v, self.meta, pdl=self.pdl)
            return decode_attention(q, self.cache, layer, self.meta, self.scale, config=self.decode_config,
                                    mass=self.mass, pdl=self.pdl)
        self.impl.write_kv(self.cache, layer, k, v, self.meta)
        if self.mass is not None:
            return self.impl.paged_attention(q, self.cache, layer, self.meta, self.scale, mass=self.mass)
        return self.impl.paged_attention(q, self.cache, layer, self.meta, self.scale)


def attention_impl(device: torch.device):
    """Triton kernels on CUDA, the pure-torch reference elsewhere; both take the same arguments."""
    if device.type == "cuda":
        from sliderl import kernels
        return kernels
    return torch_attention
