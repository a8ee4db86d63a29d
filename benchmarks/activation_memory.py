"""Activation memory a decoder layer keeps for backward, per token: what ``learner.checkpoint_layers`` trades.

    python benchmarks/activation_memory.py [--shapes 1.7b 7b] [--tokens 256 512] [--out DIR]

A layer that is recomputed in backward (gradient checkpointing) keeps only its input, ``h`` (2·d bytes a token in
bf16); a layer that is not keeps every tensor autograd saves for its backward. This script measures the second on
the CPU, exactly, for one bf16 ``core.model.DecoderLayer`` of the given shape (random weights): it runs the layer's
forward under ``torch.autograd.graph.saved_tensors_hooks`` and adds up the bytes of the distinct storages the hooks
see, leaving out the parameters, the layer's input and RoPE's cos/sin (kept either way: a recomputed layer keeps
its input, and cos/sin are one copy for all layers). The count does not depend on the device, since it is
the tensors autograd keeps, not the kernels that fill them, except inside attention: the GPU's FlexAttention keeps
q, k, v, its output and a float32 log-sum-exp per query head, where the CPU's SDPA keeps other buffers. So the
attention call runs unhooked here and its saves are added as FlexAttention's: q, k and v (bf16) and the
log-sum-exp (its output is the input o_proj already keeps, counted once).

Rows: per shape and ``--compiled`` off/on (``learner.compile_elementwise``: the norm, q/k-norm + RoPE and SiLU·mul
chains as ``torch.compile``d graphs, whose backward keeps what the compiler chose), bytes per token, measured at
each ``--tokens`` (they must agree: the count is linear in T), and the extra memory of a layer left un-recomputed
at 16,512 tokens a micro-batch (a 32K truncated window: 128 + 4 x 4,096). ``rows.jsonl`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.learner_scaling import QWEN2_7B  # noqa: E402
from sliderl.core.model import DecoderLayer, ModelConfig  # noqa: E402
from sliderl.core.tiny import QWEN3_1P7B  # noqa: E402

WINDOW_TOKENS = 128 + 4 * 4096


def hf_config(shape: str):
    from transformers import Qwen2Config, Qwen3Config

    return Qwen3Config(**QWEN3_1P7B) if shape == "1.7b" else Qwen2Config(**QWEN2_7B)


class FlexLikeSaves:
    """Causal SDPA run with the hooks off; records what FlexAttention would keep (q, k, v, float32 lse)."""

    def __init__(self):
        self.counting = True
        self.flex_bytes = 0

    def __call__(self, layer: int, q, k, v):
        self.counting = False
        try:
            groups = q.shape[1] // k.shape[1]
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(groups, 1).transpose(0, 1),
                v.repeat_interleave(groups, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
        finally:
            self.counting = True
        self.flex_bytes += sum(t.numel() * t.element_size() for t in (q, k, v)) + 4 * q.shape[1] * q.shape[0]
        return out


def saved_bytes(layer: DecoderLayer, config: ModelConfig, tokens: int, compiled: bool) -> dict:
    """Bytes of the distinct non-parameter storages a forward of ``tokens`` tokens saves, and FlexAttention's."""
    from sliderl.core.model import RotaryEmbedding

    torch.manual_seed(0)
    h = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = RotaryEmbedding(config)(torch.arange(tokens), torch.bfloat16)
    # kept either way: the weights, the layer's input (a recomputed layer keeps it too) and cos/sin (one copy
    # for every layer)
    kept = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), h, cos, sin)}
    storages: dict[int, int] = {}
    attn = FlexLikeSaves()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if attn.counting and ptr not in kept:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(h, cos, sin, attn, compiled=compiled)
    out.float().pow(2).mean().backward()  # the saves were usable: backward runs
    return {"hooked": sum(storages.values()), "flex": attn.flex_bytes}


def measure(shape: str, tokens_list: list[int], compiled: bool) -> dict:
    config = ModelConfig.from_hf(hf_config(shape))
    torch.manual_seed(0)
    layer = DecoderLayer(config, 0).to(torch.bfloat16)
    per_token = []
    for tokens in tokens_list:
        got = saved_bytes(layer, config, tokens, compiled)
        per_token.append((got["hooked"] + got["flex"]) / tokens)
    per = per_token[-1]
    return {"shape": shape, "compiled": compiled, "tokens": tokens_list, "extra_bytes_per_token": per_token,
            "input_bytes_per_token": 2 * config.hidden_size,
            "extra_gib_per_layer_at_window": per * WINDOW_TOKENS / 2**30,
            "num_layers": config.num_layers, "window_tokens": WINDOW_TOKENS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=("1.7b", "7b"), default=["1.7b", "7b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--compiled", choices=("off", "on", "both"), default="both")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    variants = {"off": [False], "on": [True], "both": [False, True]}[args.compiled]
    rows = [measure(shape, args.tokens, c) for shape in args.shapes for c in variants]
    print(f"{'shape':>5} {'compiled':>8} {'extra KiB/token (each T)':>26} {'input KiB/token':>15} "
          f"{'extra GiB/layer @16,512':>23} {'x layers':>8}")
    for r in rows:
        each = " / ".join(f"{b / 1024:.2f}" for b in r["extra_bytes_per_token"])
        print(f"{r['shape']:>5} {str(r['compiled']):>8} {each:>26} {r['input_bytes_per_token'] / 1024:>15.2f} "
              f"{r['extra_gib_per_layer_at_window']:>23.2f} "
              f"{r['extra_gib_per_layer_at_window'] * r['num_layers']:>8.1f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "rows.jsonl").open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
