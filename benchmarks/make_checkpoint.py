"""A Qwen3-family checkpoint with random weights, as a user's would look: the model's real config,
bf16 safetensors written by ``save_pretrained``, a tokenizer built locally with a Qwen3-style chat
template, and a generation config whose end-of-sequence ids the engines honour.

    python benchmarks/make_checkpoint.py OUT_DIR [--size 1.7b|0.6b|tiny] [--stop-ids 150] [--device cuda]

Nothing is downloaded: the shapes are Qwen3-0.6B's or Qwen3-1.7B's (``tiny``: a 2-layer model for
CPU checks); the tokenizer is ``core.tiny``'s byte-level one (ids 0-255 are bytes, then
``<|endoftext|>`` 256, ``<|im_start|>`` 257, ``<|im_end|>`` 258, ``<think>`` 259, ``</think>`` 260), with
``CHAT_TEMPLATE`` below (ChatML; ``enable_thinking=False`` writes an empty think block, as Qwen3's
does). ``generation_config.json`` ends a sequence at ``<|im_end|>`` or ``<|endoftext|>`` — and, with
``--stop-ids K``, at K more ids spread over the vocabulary: a random model samples nearly uniformly over
151,936 ids, so it would almost never stop; with K extra stop ids a completion ends after about
151,936 / K tokens on average (geometric), and lengths, and so length- or KV-based rewards, vary within
a group as a trained model's do. sliderl's engine and transformers' ``generate`` (TRL) both read these
ids, so both stop at the same places.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# ChatML as Qwen3 writes it, in short: every message in <|im_start|>role ... <|im_end|>, then the
# assistant's generation prompt; enable_thinking=false pre-fills an empty think block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_QWEN3 = dict(vocab_size=151936, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
              max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1_000_000)
SIZES = {
    "1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144),  # = core.tiny.QWEN3_1P7B
    "0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072),
    "tiny": dict(_QWEN3, vocab_size=261, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
}
FIRST_STOP_ID = 1000  # extra stop ids start past the byte tokenizer's 261 tokens (tiny: inside the bytes)


def stop_ids(vocab_size: int, count: int) -> list[int]:
    """``count`` ids spread evenly over ``[FIRST_STOP_ID, vocab_size)`` (over the bytes 128-255 for a vocabulary
    that small, i.e. tiny)."""
    low = FIRST_STOP_ID if vocab_size > 2 * FIRST_STOP_ID else 128
    high = vocab_size if low == FIRST_STOP_ID else 256
    if count > high - low:
        raise ValueError(f"--stop-ids {count} is more than the {high - low} ids in [{low}, {high})")
    return [low + (i * (high - low)) // count for i in range(count)]


def build_tokenizer():
    """The byte-level tokenizer of ``core.tiny`` with the Qwen3-style ``CHAT_TEMPLATE``."""
    from sliderl.core.tiny import build_tokenizer as byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_checkpoint(out_dir: str | Path, size: str = "1.7b", extra_stop_ids: int = 0, device: str | None = None,
                    dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Write the checkpoint (see the module docstring) to ``out_dir``; its path."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid: {', '.join(SIZES)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = build_tokenizer()
    end = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    config = Qwen3Config(**SIZES[size], bos_token_id=None, eos_token_id=end, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(eos_token_id=end + stop_ids(config.vocab_size, extra_stop_ids),
                                               pad_token_id=tokenizer.eos_token_id)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(str(out))
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=list(SIZES), default="1.7b")
    parser.add_argument("--stop-ids", type=int, default=0, help="extra end-of-sequence ids (see the docstring)")
    parser.add_argument("--device", default=None, help="where the random weights are drawn (default: cuda if any)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = make_checkpoint(args.out_dir, args.size, args.stop_ids, args.device, seed=args.seed)
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    print(f"{path}: Qwen3 {args.size} config, random bf16 weights, {len(eos)} end-of-sequence ids")


if __name__ == "__main__":
    main()
