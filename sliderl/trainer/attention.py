"""Training attention: the trace's KV policy as an ``AttentionBackend`` for ``DecoderLM``, teacher-forced.

Several training windows are packed into one flat stream of N tokens. Each token carries its
original position, its *death* (``KVPolicy.death_positions`` over the whole trace, so cutting a
window out of the trace changes no key's death) and its document (which window it belongs to).
A query at flat index i sees the key at flat index j exactly when

    doc[j] == doc[i]  and  pos[j] <= pos[i] < death[j]          (DESIGN.md, "The one rule")

One rule covers every policy: ``full`` (death never), ``prefix_sliding``, ``sliding_window``,
``streaming`` (death = position + W outside the kept prefix) and ``registers`` (death = the
position of the register token that killed the step). Every query sees at least itself.

A ``pasta`` window (``core.pasta``) also carries each token's thread, ``exposed_at`` and
``view_at``, and its tokens' positions above are their indices in the trace (write order), while
the model gets the layout's position ids; the rule then also needs

    thread[j] == thread[i]  or  exposed_at[j] <= view_at[i]          (core.pasta.thread_visible)

A ``planned_diffusion`` window (``core.planned_diffusion``) is the same rule read with spans for threads: a
token's position here is its *write time* (a span token's is its span's first index, so a span sees itself in
both directions), and the noised copies of its spans, packed after the clean response, are threads of their own.

Backends (all GQA-aware, scale 1/sqrt(D), output in q's dtype):
  flex  FlexAttention with a ``mask_mod`` reading the position/death/document tensors and a block
        mask (block sparsity skips out-of-window and dead tiles). Compiled with ``torch.compile``
        by default. The stream is padded to a power-of-two bucket (>= 128) so a few compiled
        shapes serve every batch. torch 2.13 has no FlexAttention backward on CPU, and compiling it
        on CPU takes tens of seconds cold, so ``auto`` uses it on CUDA only.
  sdpa  ``scaled_dot_product_attention`` (the CPU training path, forward and backward): with the
        dense ``[N, N]`` bool mask, or — when the stream holds many short documents, so that
        D·T² (T the longest document) is under half of N² — over the documents as a padded
        ``[D, T]`` batch with one ``[T, T]`` mask each (``DocumentBatch``), or ``is_causal`` when the
        stream is one document under ``full``.
  dense ``core.model.DenseAttention`` over the same mask (reference; float64 capable).

``auto`` on CUDA also takes the per-document SDPA when a stream packs many short documents (every
one at most ``SHORT_DOCUMENT`` tokens): FlexAttention's block mask is built by evaluating the rule
at all N² (query, key) pairs of the padded stream, while the documents hold only D·T² of them — an
SFT step of 64 register traces of ~620 tokens packed into one 64K stream spent ~0.9 s per step
building its block mask on the H200 (6 runs sharing it), against ~25M mask entries per document
batch. Inside a short document block sparsity has little to skip, so flex gains nothing there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from sliderl.core.kv_policy import NEVER
from sliderl.core.model import AttentionBackend, DenseAttention
from sliderl.core.pasta import thread_visible

ATTENTION_BACKENDS = ("auto", "flex", "sdpa", "dense")
_MIN_FLEX_BUCKET = 128
SHORT_DOCUMENT = 2048  # tokens: on CUDA, streams of documents no longer than this batch per document


@dataclass(frozen=True)
class PackedVisibility:
    """Per-token visibility data of a packed stream; all ``[N]`` int64 on one device."""

    positions: Tensor  # index in its trace (write order; the position id except under pasta and planned_diffusion)
    death: Tensor  # first query position that no longer sees this token as a key
    doc: Tensor  # document (window) index, 0..D-1, non-decreasing
    thread: Tensor | None = None  # pasta: thread within its document (0 main); None: one thread everywhere
    exposed_at: Tensor | None = None  # pasta: trace index from which other threads see this key
    view_at: Tensor | None = None  # pasta: trace index where this query's view of other threads stops

    @classmethod
    def pack(cls, parts: Sequence[tuple[Tensor, ...]]) -> PackedVisibility:
        """Concatenate D windows' ``(positions, death)``, or ``(positions, death, thread, exposed_at, view_at)``
        for a pasta window (``core.pasta.PastaLayout``), each ``[n_i]``; document i gets id i.
        With any pasta window, the others get one thread (0) each."""
        if not parts:
            raise ValueError("cannot pack zero windows")
        if any(len(p) not in (2, 5) for p in parts):
            raise ValueError(f"each window packs 2 tensors (positions, death) or 5 (pasta: positions, death, thread, "
                             f"exposed_at, view_at), got {sorted({len(p) for p in parts})}")
        docs = [torch.full_like(p[0], i) for i, p in enumerate(parts)]
        if any(len(p) == 5 for p in parts):
            parts = [p if len(p) == 5 else (*p, *[torch.zeros_like(p[0])] * 3) for p in parts]
        columns = [torch.cat(column).long() for column in zip(*parts)]
        return cls(columns[0], columns[1], torch.cat(docs).long(), *columns[2:])

    def __len__(self) -> int:
        return self.positions.shape[0]

    @property
    def num_docs(self) -> int:
        return int(self.doc[-1]) + 1 if len(self) else 0

    @property
    def causal_only(self) -> bool:
        """True when no key ever dies (``full``) and every document is one thread: plain causal attention
        within each document."""
        return bool((self.death >= NEVER).all()) and (self.thread is None or not bool(self.thread.any()))

    def to(self, device: torch.device | str) -> PackedVisibility:
        move = lambda x: None if x is None else x.to(device)  # noqa: E731
        return PackedVisibility(*(move(getattr(self, f.name)) for f in fields(self)))

    def dense_mask(self) -> Tensor:
        """``[N, N]`` bool, True where query row i sees key column j (the rule above)."""
        index = torch.arange(len(self), device=self.positions.device)
        return self.mask_mod()(0, 0, index[:, None], index[None, :])

    def mask_mod(self):
        """The rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` over flat indices (any broadcasting
        index tensors)."""
        pos, death, doc = self.positions, self.death, self.doc

        def visible(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (pos[kv_idx] <= pos[q_idx]) & (pos[q_idx] < death[kv_idx])

        if self.thread is None:
            return visible
        thread, exposed, view = self.thread, self.exposed_at, self.view_at

        def visible_in_threads(b, h, q_idx, kv_idx):
            return visible(b, h, q_idx, kv_idx) & thread_visible(thread[q_idx], view[q_idx], thread[kv_idx],
                                                                 exposed[kv_idx])

        return visible_in_threads

    def document_batch(self) -> DocumentBatch:
        """The stream as a ``[D, T]`` batch of its documents (T the longest), each with its own mask."""
        counts = torch.bincount(self.doc, minlength=self.num_docs)  # [D]
        width, num_docs = int(counts.max()), self.num_docs
        starts = torch.cumsum(counts, 0) - counts  # [D]
        offset = torch.arange(len(self), device=self.doc.device) - starts[self.doc]  # [N]
        slot = self.doc * width + offset  # [N] flat index into [D * T]
        gather = starts.repeat_interleave(width)  # pad slots read their document's first token
        gather[slot] = torch.arange(len(self), device=self.doc.device)
        mask = torch.eye(width, dtype=torch.bool, device=self.doc.device).repeat(num_docs, 1, 1)  # pads see themselves
        visible = self.mask_mod()
        for d in range(num_docs):
            a, n = int(starts[d]), int(counts[d])
            index = torch.arange(a, a + n, device=self.doc.device)
            mask[d, :n, :n] = visible(0, 0, index[:, None], index[None, :])
        return DocumentBatch(gather.view(num_docs, width), slot, mask)

    def prefers_document_batch(self, max_document: int | None = None) -> bool:
        """True when padding the documents into one batch needs under half the dense mask's entries (and,
        with ``max_document``, no document is longer than that)."""
        counts = torch.bincount(self.doc, minlength=self.num_docs)
        longest = int(counts.max())
        return (self.num_docs > 1 and 2 * self.num_docs * longest ** 2 < len(self) ** 2
                and (max_document is None or longest <= max_document))

    def padded(self, n: int) -> PackedVisibility:
        """Append ``n - N`` pad tokens (document -1, pad i at position i with death i + 1): each sees only
        itself, so a block mask over the padded stream holds just the diagonal of the pad x pad square
        (pads seeing each other made FlexAttention compute that square densely: 4x a 32K trace's real
        attention when it is padded to 64K)."""
        extra = n - len(self)
        if extra <= 0:
            return self
        pad = torch.arange(extra, dtype=torch.int64, device=self.positions.device)
        threads = () if self.thread is None else [torch.cat([x, torch.zeros_like(pad)])  # one thread: no effect
                                                  for x in (self.thread, self.exposed_at, self.view_at)]
        return PackedVisibility(torch.cat([self.positions, pad]), torch.cat([self.death, pad + 1]),
                                torch.cat([self.doc, torch.full_like(pad, -1)]), *threads)


@dataclass(frozen=True)
class DocumentBatch:
    """A packed stream's D documents as a padded ``[D, T]`` batch (``PackedVisibility.document_batch``)."""

    gather: Tensor  # [D, T] int64 stream index of each slot (a pad slot repeats its document's first token)
    slot: Tensor  # [N] int64 index into the flattened [D * T] slots of each stream token
    mask: Tensor  # [D, T, T] bool, one document's visibility each; pad slots see only themselves


# ---------------------------------------------------------------- backends


def _heads_first(x: Tensor) -> Tensor:
    """[N, H, D] -> [1, H, N, D]."""
    return x.transpose(0, 1).unsqueeze(0)


def _tokens_first(x: Tensor) -> Tensor:
    """[1, H, N, D] -> [N, H, D]."""
    return x.squeeze(0).transpose(0, 1)


class MaskedSDPA:
    """``scaled_dot_product_attention`` over an explicit ``[N, N]`` bool mask, causal when ``mask`` is None,
    or over ``documents`` (a ``DocumentBatch``: one padded row and mask per document) when given."""

    def __init__(self, mask: Tensor | None, documents: DocumentBatch | None = None):
        if mask is not None and (mask.dim() != 2 or mask.shape[0] != mask.shape[1] or mask.dtype != torch.bool):
            raise ValueError(f"MaskedSDPA mask must be a square [N, N] bool tensor, "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        self.mask = mask
        self.documents = documents

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [N, H_q, D], k/v: [N, H_kv, D] -> [N, H_q, D]."""
        if self.documents is not None:
            return self._per_document(q, k, v)
        if self.mask is not None and self.mask.shape[0] != q.shape[0]:
            raise ValueError(f"MaskedSDPA mask is for {self.mask.shape[0]} tokens, got {q.shape[0]}")
        out = F.scaled_dot_product_attention(_heads_first(q), _heads_first(k), _heads_first(v),
                                             attn_mask=self.mask, is_causal=self.mask is None, enable_gqa=True)
        return _tokens_first(out)

    def _per_document(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        docs = self.documents
        if docs.slot.shape[0] != q.shape[0]:
            raise ValueError(f"MaskedSDPA documents are for {docs.slot.shape[0]} tokens, got {q.shape[0]}")
        batch = lambda x: x[docs.gather].transpose(1, 2)  # noqa: E731  [N, H, D] -> [B, H, T, D]
        out = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), attn_mask=docs.mask[:, None],
                                             enable_gqa=True)  # [B, H_q, T, D]
        return out.transpose(1, 2).flatten(0, 1)[docs.slot]  # [N, H_q, D]


_compiled_flex = None


def _flex_attention(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if not compiled:
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex_bucket(n: int) -> int:
    """The padded stream length for n tokens: the next power of two, at least 128."""
    return max(_MIN_FLEX_BUCKET, 1 << (max(n, 1) - 1).bit_length())


class FlexPolicyAttention:
    """FlexAttention over a ``PackedVisibility``; the block mask is built once and shared by every layer.

    compiled: run ``torch.compile(flex_attention)`` (required for speed and for backward on CUDA);
    False runs FlexAttention's eager reference, forward only on CPU (used by tests). kernel_options: passed to
    ``flex_attention`` as they are (tile sizes, stages, warps; ``fwd_``/``bwd_`` prefixes for one pass), None for
    FlexAttention's defaults (``benchmarks/flex_attention.py`` times them).
    """

    def __init__(self, visibility: PackedVisibility, *, compiled: bool = True, kernel_options: dict | None = None):
        from torch.nn.attention.flex_attention import create_block_mask

        self.num_tokens = len(visibility)
        size = flex_bucket(self.num_tokens)
        padded = visibility.padded(size)
        device = padded.positions.device
        self.block_mask = create_block_mask(padded.mask_mod(), None, None, size, size, device=device,
                                            _compile=compiled and device.type == "cuda")
        self.flex = _flex_attention(compiled)
        self.size = size
        self.kernel_options = kernel_options

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [N, H_q, D], k/v: [N, H_kv, D] -> [N, H_q, D]."""
        n = q.shape[0]
        if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
            raise NotImplementedError("FlexAttention has no backward on CPU in this torch; train on CPU with "
                                      "attention 'sdpa' (what 'auto' picks) or run flex under torch.no_grad()")
        if n != self.num_tokens:
            raise ValueError(f"FlexPolicyAttention was built for {self.num_tokens} tokens, got {n}")
        pad = lambda x: F.pad(x, (0, 0, 0, 0, 0, self.size - n))  # noqa: E731  [N, H, D] -> [size, H, D]
        out = self.flex(_heads_first(pad(q)), _heads_first(pad(k)), _heads_first(pad(v)),
                        block_mask=self.block_mask, enable_gqa=True, kernel_options=self.kernel_options)
        return _tokens_first(out)[:n]


def auto_backend(visibility: PackedVisibility, device_type: str) -> str:
    """What ``auto`` runs for ``visibility`` on a ``device_type`` device: ``causal`` (one ``full`` document),
    ``documents`` (SDPA per document), ``flex`` or ``sdpa`` (the dense mask)."""
    if visibility.causal_only and visibility.num_docs == 1:
        return "causal"
    if device_type == "cuda":
        return "documents" if visibility.prefers_document_batch(SHORT_DOCUMENT) else "flex"
    return "documents" if visibility.prefers_document_batch() else "sdpa"


def training_attention(visibility: PackedVisibility, device: torch.device | str,
                       backend: str = "auto") -> AttentionBackend:
    """The attention backend for a packed stream on ``device``; ``backend`` in ``ATTENTION_BACKENDS``.

    auto (``auto_backend``): causal SDPA for one ``full`` document; otherwise compiled flex on CUDA,
    masked SDPA on CPU (per document when that is cheaper, and on CUDA when every document is short:
    see the module docstring). sdpa: per document when cheaper, else the dense mask.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; valid: {', '.join(ATTENTION_BACKENDS)}")
    device = torch.device(device)
    visibility = visibility.to(device)
    if backend == "auto":
        backend = auto_backend(visibility, device.type)
        if backend == "causal":
            return MaskedSDPA(None)
    if backend == "flex":
        return FlexPolicyAttention(visibility)
    if backend == "dense":
        return DenseAttention(visibility.dense_mask())
    if backend == "documents" or visibility.prefers_document_batch():
        return MaskedSDPA(None, visibility.document_batch())
    return MaskedSDPA(visibility.dense_mask())
