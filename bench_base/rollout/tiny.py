"""Tiny random-initialised models and a byte-level tokenizer, built locally (tests, default job, benchmarks).

``make_tiny_model`` writes a complete Hugging Face directory — config.json, safetensors weights,
tokenizer, generation_config.json — that ``rollout.loader`` and ``transformers`` both load.

    python -m rollout.tiny OUT_DIR --arch qwen3
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rollout.kv_policy import register_tokens

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")  # added, not special: kept by decode(skip_special_tokens=True), as in Qwen3
ARCHS = ("qwen3", "qwen2", "llama")

# A Qwen-style ChatML template; enough for prompts built with apply_chat_template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(extra_special_tokens: tuple[str, ...] | list[str] = ()):
    """A byte-level BPE tokenizer: id b is byte b for 0-255 (no merges), then the special tokens.

    ``<|endoftext|>`` (id 256) is eos and pad; ``<|im_start|>``, ``<|im_end|>`` are special;
    ``<think>``, ``</think>`` are single added tokens; ``extra_special_tokens`` (e.g. ``<reg_0>``)
    follow in order. ASCII text round-trips through encode/decode exactly.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab={symbol: b for b, symbol in enumerate(byte_symbols())}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special_tokens])
    specials = [t for t in (*SPECIAL_TOKENS, *extra_special_tokens) if t != EOS_TOKEN]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                        extra_special_tokens=specials,
                                        clean_up_tokenization_spaces=False, model_max_length=1 << 20)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def byte_symbols() -> list[str]:
    """The ByteLevel symbol of every byte 0..255 (GPT-2's map: printable bytes stand for themselves,
    the other bytes become ``chr(256 + n)`` in byte order)."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    symbols, shifted = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def hf_config(arch: str, vocab_size: int, eos_token_id: int, *, hidden_size: int, num_layers: int, num_heads: int,
              num_kv_heads: int, intermediate_size: int, max_position_embeddings: int, tie_word_embeddings: bool,
              initializer_range: float = 0.2, **overrides):
    """The transformers config object (Qwen3Config, Qwen2Config or LlamaConfig) of a tiny model."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}
    if arch not in classes:
        raise ValueError(f"unknown tiny-model arch {arch!r}; valid: {', '.join(ARCHS)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}, "
                         f"and num_heads by num_kv_heads={num_kv_heads}")
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
                  tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range,
                  bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)
    kwargs.update(overrides)
    return classes[arch](**kwargs)


def make_tiny_model(out_dir: str | Path, arch: str = "qwen3", *, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    max_position_embeddings: int = 4096, tie_word_embeddings: bool = True, seed: int = 0,
                    dtype: torch.dtype = torch.float32, max_shard_size: int | str | None = None,
                    extra_special_tokens: tuple[str, ...] = (), **config_overrides) -> Path:
    """Write a random-initialised ``arch`` model with the byte-level tokenizer to ``out_dir``; return the path.

    ``config_overrides`` go to the transformers config class (e.g. ``attention_bias=True``,
    ``rope_parameters={...}``, ``initializer_range=0.1``). Weights are saved as safetensors, sharded
    when ``max_shard_size`` is given (e.g. ``"100KB"``).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tokenizer(extra_special_tokens)
    eos = tokenizer.eos_token_id
    config = hf_config(arch, len(tokenizer), eos, hidden_size=hidden_size, num_layers=num_layers,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                       max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                       **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **save_kwargs)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random model directory (HF format).")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="qwen3")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--untied", action="store_true", help="separate lm_head and embedding matrices")
    parser.add_argument("--registers", type=int, default=0, help="add <reg_0>..<reg_{N-1}> special tokens")
    args = parser.parse_args(argv)
    extra = tuple(register_tokens(args.registers))
    path = make_tiny_model(args.out_dir, args.arch, hidden_size=args.hidden_size, num_layers=args.num_layers,
                           num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                           intermediate_size=args.intermediate_size, tie_word_embeddings=not args.untied,
                           seed=args.seed, extra_special_tokens=extra)
    print(path)


if __name__ == "__main__":
    main()
