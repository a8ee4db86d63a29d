"""The decoder-only language model that both the engine and the trainer run.

One implementation of the Qwen3, Qwen2 and Llama families over *flat token streams*: a batch is N
tokens with no batch dimension, each carrying its true position (Continue PE: RoPE is applied once,
at that position). Attention itself is delegated to an ``AttentionBackend`` — the engine passes one
over its paged KV cache, the trainer and the tests a ``DenseAttention`` over an explicit mask — so
sampler and trainer compute the same function.

Module and parameter names equal Hugging Face's (``model.embed_tokens``,
``model.layers.{i}.self_attn.q_proj``, ``model.norm``, ``lm_head`` …), so a HF state dict maps 1:1.
On the inference path q/k/v and gate/up each run as one GEMM over a fused weight whose row blocks
*are* those parameters (``FusedLinears``): one copy of the weights, still loaded and synced by HF name.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from sliderl.kernels.launch_checks import interpreting

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
# RoPE variants whose frequencies are fixed; "dynamic" and "longrope" change with sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Tensors that old checkpoints carry but that the model recomputes from its config.
_IGNORED_WEIGHT_SUFFIXES = (".rotary_emb.inv_freq",)
GEMV_MAX_TOKENS = 8  # with ``DecoderLM.gemv_kernels``, linears over at most this many tokens run kernels.gemv


class AttentionBackend(Protocol):
    """Attention over a flat token stream; RoPE is already applied to q and k."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [N, H_q, D], k/v: [N, H_kv, D] -> o: [N, H_q, D] in q's dtype."""
        ...


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers the model needs, read once from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool  # biases on q_proj/k_proj/v_proj
    o_bias: bool  # bias on o_proj
    mlp_bias: bool  # biases on gate/up/down projections
    qk_norm: bool  # Qwen3's per-head RMSNorm on q and k before RoPE
    max_position_embeddings: int
    rope_type: str
    rope_inv_freq: tuple[float, ...]  # [head_dim // 2] float32 values from transformers' RoPE init
    rope_attention_scaling: float  # multiplies cos and sin (yarn); 1.0 otherwise

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Read a ``transformers`` config of model_type qwen3, qwen2 or llama."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        layer_types = getattr(hf_config, "layer_types", None) or []
        if "sliding_attention" in layer_types:
            raise ValueError(f"{model_type} config enables sliding-window layers (use_sliding_window=True), which "
                             "this model does not implement; only full-attention layers are supported")
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        rope_type, inv_freq, scaling = rope_frequencies(hf_config, head_dim)
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            hidden_act=hf_config.hidden_act,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=hf_config.max_position_embeddings,
            rope_type=rope_type,
            rope_inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(scaling),
        )


def rope_frequencies(hf_config: Any, head_dim: int) -> tuple[str, Tensor, float]:
    """(rope_type, inv_freq [head_dim // 2] float32, attention_scaling) as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # transformers 5 keeps everything in rope_parameters; 4.x used rope_scaling + rope_theta.
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported; only 1.0")
    if rope_type == "default":  # transformers 5 keeps the default formula inside each model class
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return rope_type, inv_freq, 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    return rope_type, inv_freq.float().cpu(), scaling


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as transformers does.

    Given a ``residual``, the layer's residual add comes first: ``(norm(x + residual), x + residual)``.
    ``fused`` runs it all as one Triton launch (``kernels.norm_rope``), for inference on x of shape [N, D].
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None,
                fused: bool = False, compiled: bool = False, pdl: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        if fused:
            from sliderl.kernels.norm_rope import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, pdl=pdl)
        if residual is not None:
            return elementwise(add_rms_norm_math, compiled)(x, residual, self.weight, self.eps)
        return elementwise(rms_norm_math, compiled)(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin at arbitrary true positions. ``inv_freq`` stays float32 whatever the model is cast to."""

    inv_freq: Tensor

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        values = torch.tensor(self.config.rope_inv_freq, dtype=torch.float32)
        self.inv_freq = values.to(self.inv_freq.device)

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .to_empty() must not round or blank the frequencies: rebuild them on the new device.
        super()._apply(fn, recurse)
        self.reset_parameters()
        return self

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: [N] -> cos, sin: [N, D] in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.config.rope_attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [N, H, D]; cos/sin: [N, D]. Rotate-half convention (HF Llama/Qwen)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# The layer's element-wise chains as plain functions: the eager path calls them as they are, and with
# ``DecoderLM.compile_elementwise`` (training on CUDA) each runs as one ``torch.compile``d graph, so that its
# forward and its backward are a fused kernel or two instead of a pass over [tokens, hidden] per op.

def rms_norm_math(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in float32, cast back before the weight (as transformers)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_math(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add and the next norm: ``(norm(x + residual), x + residual)``."""
    s = x + residual
    return rms_norm_math(s, weight, eps), s


def qk_norm_rope_math(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None,
                      k_weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """q/k-norm (when the model has one: weights given) and RoPE of q ``[N, H_q, D]`` and k ``[N, H_kv, D]``."""
    if q_weight is not None:
        q, k = rms_norm_math(q, q_weight, eps), rms_norm_math(k, k_weight, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def silu_mul_math(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


# tests on CPU without a C++ compiler use "aot_eager" (the same graphs, unfused; SLIDERL_COMPILE_BACKEND in a
# rank's environment)
COMPILE_BACKEND = os.environ.get("SLIDERL_COMPILE_BACKEND", "inductor")


def elementwise(fn, compiled: bool):
    """``fn`` itself, or (``compiled``) its ``torch.compile``d graph for ``COMPILE_BACKEND``."""
    return _compiled(fn, COMPILE_BACKEND) if compiled else fn


@functools.cache
def _compiled(fn, backend: str):
    # dynamic: micro-batches vary in length, and one graph with a symbolic token count serves them all
    return torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)


def gemv_applies(x: Tensor) -> bool:
    """Whether ``linear(x, ..., gemv=True)`` runs ``kernels.gemv``: 1..``GEMV_MAX_TOKENS`` rows on CUDA
    (or under ``TRITON_INTERPRET=1``)."""
    return 0 < x.shape[0] <= GEMV_MAX_TOKENS and (x.is_cuda or interpreting())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, gemv: bool = False, pdl: bool = False) -> Tensor:
    """``F.linear``; with ``gemv`` where ``gemv_applies`` the split-K GEMV kernel runs instead (``kernels.gemv``:
    W read once), launched into a PDL chain with ``pdl`` (``kernels.pdl``)."""
    if gemv and gemv_applies(x):
        from sliderl.kernels.gemv import gemv as gemv_kernel
        return gemv_kernel(x, weight, bias, pdl=pdl)
    return F.linear(x, weight, bias)


class FusedLinears:
    """Several ``nn.Linear`` over one input as one GEMM, without a second copy of their weights.

    ``weight [sum N_i, K]`` (and ``bias``) is one tensor whose row blocks *are* the linears'
    parameters: ``fuse`` re-points each ``linear.weight.data`` at its rows. In-place writes to the
    parameters (``load_weights``, optimizer steps) therefore reach the fused GEMM, and the parameters
    keep their Hugging Face names. Whatever gives a parameter new storage (``module.to``,
    ``to_empty``) must be followed by ``fuse`` again: the owning module's ``_apply`` does it
    (``refresh``), and ``__call__`` refuses to run on a stale fusion.
    """

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self.starts = [sum(self.sizes[:i]) for i in range(len(linears))]  # first row of each in the fused weight
        self.fuse()

    @torch.no_grad()
    def fuse(self) -> None:
        self.weight = self._fused([lin.weight for lin in self.linears])
        has_bias = [lin.bias is not None for lin in self.linears]
        assert all(has_bias) or not any(has_bias), "fused linears must all have a bias or none"
        self.bias = self._fused([lin.bias for lin in self.linears]) if all(has_bias) else None

    def _fused(self, params: list[nn.Parameter]) -> Tensor:
        fused = torch.cat([p.detach() for p in params])  # [sum N_i, ...]
        for p, rows in zip(params, fused.split(self.sizes)):
            p.data = rows
        return fused

    def is_current(self) -> bool:
        """Every parameter still lives at its rows of the fused tensors."""
        for fused, name in ((self.weight, "weight"), (self.bias, "bias")):
            if fused is None:
                continue
            row_bytes = fused.stride(0) * fused.element_size()
            if any(getattr(lin, name).data_ptr() != fused.data_ptr() + start * row_bytes
                   for lin, start in zip(self.linears, self.starts)):
                return False
        return True

    def refresh(self) -> None:
        """``fuse`` again if any parameter has left its rows (in-place conversions keep the fusion)."""
        if not self.is_current():
            self.fuse()

    def __call__(self, x: Tensor, gemv: bool = False, pdl: bool = False) -> tuple[Tensor, ...]:
        """x: [N, K] -> one [N, N_i] view per linear, in order."""
        return self.joined(x, gemv, pdl).split(self.sizes, dim=-1)

    def joined(self, x: Tensor, gemv: bool = False, pdl: bool = False) -> Tensor:
        """x: [N, K] -> [N, sum N_i], the linears' outputs side by side."""
        assert self.is_current(), "a fused parameter was given new storage: call fuse() (see FusedLinears)"
        return linear(x, self.weight, self.bias, gemv, pdl)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.o_bias)
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.qkv.refresh()  # .to() / .to_empty() give the projections new storage
        return self

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend, fused: bool = False,
                gemv: bool = False, compiled: bool = False, pdl: bool = False) -> Tensor:
        n = x.shape[0]
        if fused:
            q, k, v = self.qkv(x, gemv, pdl)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(n, self.num_heads, self.head_dim)  # [N, H_q, D]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [N, H_kv, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if fused:
            q, k = self.fused_norm_rope(q, k, cos, sin, pdl)
        else:
            weights = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            q, k = elementwise(qk_norm_rope_math, compiled)(q, k, cos, sin, *weights, eps)
        o = attn(self.layer, q, k, v).reshape(n, self.num_heads * self.head_dim)  # [N, H_q * D]
        return linear(o, self.o_proj.weight, self.o_proj.bias, gemv, pdl) if fused else self.o_proj(o)

    def fused_norm_rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                        pdl: bool = False) -> tuple[Tensor, Tensor]:
        """q/k-norm (when the model has it) and RoPE in one Triton launch; same values as the PyTorch ops."""
        from sliderl.kernels.norm_rope import qk_norm_rope
        if self.q_norm is None:
            return qk_norm_rope(q, k, cos, sin, pdl=pdl)
        return qk_norm_rope(q, k, cos, sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, pdl=pdl)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)
        self.act_fn = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act == "silu"  # compiled: SiLU·mul as one graph (other activations stay eager)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.gate_up.refresh()
        return self

    def forward(self, x: Tensor, fused: bool = False, gemv: bool = False, compiled: bool = False,
                pdl: bool = False) -> Tensor:
        if not fused:
            if compiled and self.silu:
                return self.down_proj(elementwise(silu_mul_math, True)(self.gate_proj(x), self.up_proj(x)))
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        down = self.down_proj
        if self.silu:  # silu(gate) * up in one Triton launch, straight from the joined GEMM's output
            from sliderl.kernels.norm_rope import silu_mul
            return linear(silu_mul(self.gate_up.joined(x, gemv, pdl), pdl), down.weight, down.bias, gemv)
        gate, up = self.gate_up(x, gemv)
        return linear(self.act_fn(gate) * up, down.weight, down.bias, gemv)

    def gemv_tail(self, x: Tensor, residual: Tensor, pdl: bool = False) -> Tensor:
        """``residual + forward(x, fused=True, gemv=True)`` for a SiLU MLP where ``gemv_applies``: the gate/up
        GEMV, ``silu_mul``, then the down GEMV adding the residual to its output. (The GEMV kernel can also take
        ``silu(gate) * up`` itself, ``swiglu=True``, one launch fewer; on the H200 that launch took 92 us against
        12.4 for the plain down GEMV at 1bbeb04, ``benchmarks/gemv.py --m 1``: SiLU's temporaries cap its tiles.)"""
        from sliderl.kernels.gemv import gemv as gemv_kernel
        from sliderl.kernels.norm_rope import silu_mul
        down = self.down_proj
        gate_up = self.gate_up.joined(x, True, pdl)  # [N, 2 * intermediate]: gate, then up
        return gemv_kernel(silu_mul(gate_up, pdl), down.weight, down.bias, residual=residual, pdl=pdl)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend, fused: bool = False,
                gemv: bool = False, compiled: bool = False, pdl: bool = False) -> Tensor:
        """The layer's output ``h + attention + MLP``."""
        out, residual = self.forward_deferred(h, None, cos, sin, attn, fused, gemv, compiled, pdl)
        return out if residual is None else residual + out

    def forward_deferred(self, h: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, attn: AttentionBackend,
                         fused: bool = False, gemv: bool = False, compiled: bool = False,
                         pdl: bool = False) -> tuple[Tensor, Tensor | None]:
        """The layer with its last residual add left to the next norm: the input is ``h + residual`` (``h``
        alone when ``residual`` is None), the output ``(mlp, residual)`` stands for ``residual + mlp`` (or
        ``(output, None)`` where the add is fused already: the GEMV's MLP tail). The next layer's input norm (or
        the final norm) then adds and normalises in one launch, as the post-attention norm does."""
        if residual is None:
            x = self.input_layernorm(h, fused=fused, compiled=compiled, pdl=pdl)
        else:  # x = norm(h + residual), h = h + residual
            x, h = self.input_layernorm(h, residual, fused=fused, compiled=compiled, pdl=pdl)
        a = self.self_attn(x, cos, sin, attn, fused, gemv, compiled, pdl)
        # x = norm(h + a), h = h + a
        x, h = self.post_attention_layernorm(a, h, fused=fused, compiled=compiled, pdl=pdl)
        if fused and gemv and self.mlp.silu and gemv_applies(x):
            return self.mlp.gemv_tail(x, h, pdl), None
        return self.mlp(x, fused, gemv, compiled, pdl), h


class Backbone(nn.Module):
    """HF's ``model.`` submodule: embeddings, layers, final norm, rotary embedding."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class DecoderLM(nn.Module):
    """A Qwen3/Qwen2/Llama causal LM over flat token streams.

    ``forward(input_ids [N], positions [N], attn) -> hidden [N, hidden_size]`` (after the final
    norm); ``compute_logits(hidden) -> [N, vocab] float32``. Set ``gradient_checkpointing = True``
    to recompute each layer in backward while training, or only the first ``checkpoint_layers`` of them (the
    others keep their activations: less recomputation for more memory). Set ``fused_kernels = True`` (CUDA, or
    ``TRITON_INTERPRET=1``) to run, whenever autograd is off, the norms and q/k-norm + RoPE as Triton
    kernels, each residual add inside the norm after it (``DecoderLayer.forward_deferred``), and q/k/v and
    gate/up as one GEMM each (``FusedLinears``); with autograd on (training) the
    PyTorch ops run, which stay the reference. Set ``gemv_kernels = True`` as well to run the linear
    layers and ``compute_logits`` over at most ``GEMV_MAX_TOKENS`` tokens with ``kernels.gemv`` (a SiLU MLP's
    tail, ``h + down(silu(gate) * up)``, as one GEMV). Set ``pdl_kernels = True`` (Hopper) to launch the fused
    path's Triton kernels as a programmatic-dependent-launch chain (``kernels.pdl``). Set
    ``compile_elementwise = True`` to run those PyTorch ops' element-wise chains (the norms with their
    residual adds, q/k-norm + RoPE, SiLU·mul) as ``torch.compile``d graphs: the same math, fused forward
    and backward (the learner's ``compile_elementwise``).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.checkpoint_layers: int | None = None  # None: every layer (with gradient_checkpointing)
        self.fused_kernels = False
        self.gemv_kernels = False
        self.pdl_kernels = False
        self.compile_elementwise = False
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with ``lm_head`` when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def to_empty(self, *, device, recurse: bool = True) -> DecoderLM:
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()  # to_empty replaces parameters one module at a time, which unties them
        return self

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        h = self.model.embed_tokens(input_ids)  # [N, hidden]
        cos, sin = self.model.rotary_emb(positions, h.dtype)  # [N, D]
        fused = self.fused_kernels and not torch.is_grad_enabled()
        gemv = fused and self.gemv_kernels
        pdl = fused and self.pdl_kernels
        compiled = self.compile_elementwise and not fused
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        recomputed = len(self.model.layers) if self.checkpoint_layers is None else self.checkpoint_layers
        residual = None  # fused: each layer's last residual add is done by the next norm (one launch fewer)
        for i, layer in enumerate(self.model.layers):
            if recompute and i < recomputed:
                h = checkpoint(layer, h, cos, sin, attn, False, False, compiled, use_reentrant=False)
            elif fused:
                h, residual = layer.forward_deferred(h, residual, cos, sin, attn, fused, gemv, compiled, pdl)
            else:
                h = layer(h, cos, sin, attn, fused, gemv, compiled, pdl)
        if residual is not None:
            return self.model.norm(h, residual, fused=fused, compiled=compiled, pdl=pdl)[0]
        return self.model.norm(h, fused=fused, compiled=compiled, pdl=pdl)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab] float32."""
        gemv = self.fused_kernels and self.gemv_kernels and not torch.is_grad_enabled()
        return linear(hidden, self.lm_head.weight, None, gemv).float()

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors into the parameters in place (cast to their dtype and device).

        Unknown names and shape mismatches raise ValueError. With tied embeddings ``lm_head.weight``
        is skipped (the embedding is authoritative). Names absent from ``weights`` are left as they are.
        """
        params = dict(self.named_parameters())
        items = weights.items() if isinstance(weights, Mapping) else weights
        for name, tensor in items:
            if name.endswith(_IGNORED_WEIGHT_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"unknown weight {name!r} for a {self.config.model_type} model; "
                                 f"expected names like {', '.join(list(params)[:3])}, …")
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(param.shape)}")
            param.copy_(tensor)

    @torch.no_grad()
    def resize_vocab(self, vocab_size: int) -> None:
        """Grow the vocabulary to ``vocab_size`` rows (e.g. after adding register tokens).

        New embedding rows and new ``lm_head`` rows are the mean of the existing rows, so a new
        token's logit is the mean of the old logits. Deterministic: engine and trainer agree.
        """
        old = self.config.vocab_size
        if vocab_size < old:
            raise ValueError(f"resize_vocab can only grow the vocabulary: {old} -> {vocab_size}")
        if vocab_size == old:
            return
        embed = self.model.embed_tokens.weight
        self.model.embed_tokens = nn.Embedding(vocab_size, embed.shape[1], device=embed.device, dtype=embed.dtype)
        self.model.embed_tokens.weight.copy_(_grown_rows(embed, vocab_size))
        head = self.lm_head.weight
        self.lm_head = nn.Linear(head.shape[1], vocab_size, bias=False, device=head.device, dtype=head.dtype)
        if not self.config.tie_word_embeddings:
            self.lm_head.weight.copy_(_grown_rows(head, vocab_size))
        self.config = replace(self.config, vocab_size=vocab_size)
        self.tie_weights()

    def weight_names(self) -> list[str]:
        """The names every full checkpoint must provide (``lm_head.weight`` only when untied)."""
        return [name for name, _ in self.named_parameters()]


def _grown_rows(weight: Tensor, rows: int) -> Tensor:
    """weight: [V, H] -> [rows, H], the extra rows equal to the mean row (computed in float32)."""
    mean = weight.float().mean(0, keepdim=True).to(weight.dtype)
    return torch.cat([weight, mean.expand(rows - weight.shape[0], -1)])


class DenseAttention:
    """An ``AttentionBackend`` over an explicit ``[N, N]`` bool mask (True: query row sees key column).

    GQA by repeating KV heads; scale 1/sqrt(head_dim); scores and softmax in float32 (float64 when
    the inputs are float64); output cast back to q's dtype. A row that sees no key gets a uniform
    average instead of NaN.
    """

    def __init__(self, mask: Tensor):
        if mask.dim() != 2 or mask.shape[0] != mask.shape[1] or mask.dtype != torch.bool:
            raise ValueError(f"DenseAttention mask must be a square [N, N] bool tensor, got "
                             f"{mask.dtype} {tuple(mask.shape)}")
        self.mask = mask

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n, h_q, d = q.shape
        if self.mask.shape[0] != n:
            raise ValueError(f"DenseAttention mask is for {self.mask.shape[0]} tokens, got {n}")
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        groups = h_q // k.shape[1]
        k = k.to(acc).repeat_interleave(groups, dim=1)  # [N, H_q, D]
        v = v.to(acc).repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.to(acc), k) * (1.0 / math.sqrt(d))  # [H_q, N, N]
        scores = scores.masked_fill(~self.mask.to(q.device)[None], torch.finfo(acc).min)
        probs = F.softmax(scores, dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def causal_mask(n: int, device: torch.device | str = "cpu") -> Tensor:
    """[N, N] bool lower-triangular mask for one sequence."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()
