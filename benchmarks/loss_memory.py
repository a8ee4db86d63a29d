"""Peak memory of the loss's logits: scoring all targets at once vs in vocabulary-sized chunks.

    python benchmarks/loss_memory.py [--targets 8192 32768]          # GPU only (CUDA peak memory)

A one-layer model with the Qwen3-1.7B width and vocabulary (2048 wide, 151,936 tokens, tied
embeddings, bf16 on CUDA) scores one packed window of T targets with ``packed_logprobs`` and
backpropagates a weighted sum, once with every target's logits at once (``chunk_rows`` larger than
T: the old behaviour, [T, V] float32 held for backward) and once in the default chunks
(``LOGIT_CHUNK_ELEMENTS // V`` rows under checkpointing). Reported: peak memory allocated above the
model's own (torch.cuda.max_memory_allocated) and the step's seconds, and their ratios.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def measure(model, packed, rows: int | None, device: str) -> tuple[float, float]:
    from sliderl.trainer.logprobs import packed_logprobs
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    lp = packed_logprobs(model, packed, backend="auto", chunk_rows=rows)
    lp.float().sum().backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", type=int, nargs="+", default=[8192, 32768])
    args = parser.parse_args()
    from transformers import Qwen3Config

    from sliderl.core.kv_policy import KVPolicy
    from sliderl.core.loader import load_model
    from sliderl.core.tiny import QWEN3_1P7B, build_tokenizer
    from sliderl.trainer.logprobs import LOGIT_CHUNK_ELEMENTS, pack_windows, window_input
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoModelForCausalLM
        cfg = Qwen3Config(**{**QWEN3_1P7B, "num_hidden_layers": 1})
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp)
        build_tokenizer().save_pretrained(tmp)
        model = load_model(tmp, dtype=torch.bfloat16, device="cuda")
    print(f"chunk rows {LOGIT_CHUNK_ELEMENTS // cfg.vocab_size} of a {cfg.vocab_size} vocabulary")
    print(f"{'targets':>8}{'whole GiB':>11}{'chunked GiB':>13}{'ratio':>8}{'whole s':>9}{'chunked s':>11}")
    policy = KVPolicy.parse("full")
    for t in args.targets:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (t + 16,), generator=gen).tolist()
        packed = pack_windows([window_input(ids[:16], ids[16:], policy, 1.0)])
        measure(model, packed, None, "cuda")  # warm-up
        try:
            whole, whole_s = measure(model, packed, 10**9, "cuda")
        except torch.OutOfMemoryError:
            whole, whole_s = float("nan"), float("nan")
        chunked, chunked_s = measure(model, packed, None, "cuda")
        print(f"{t:>8}{whole:>11.2f}{chunked:>13.2f}{whole / chunked:>7.1f}x{whole_s:>9.3f}{chunked_s:>11.3f}", flush=True)


if __name__ == "__main__":
    main()
