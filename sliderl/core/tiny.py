"""Tiny random-initialised models and a byte-level tokenizer, built locally (tests, default job, benchmarks).

``make_tiny_model`` writes a complete Hugging Face directory — config.json, safetensors weights,
tokenizer, generation_config.json — that ``core.loader`` and ``transformers`` both load.

    python -m sliderl.core.tiny OUT_DIR --arch qwen3
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch

from sliderl.core.kv_policy import register_tokens

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


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that decides a tiny model's shapes and random weights (its folder name in a cache)."""

    __pydantic_config__: ClassVar[dict] = {"extra": "forbid", "use_attribute_docstrings": True}

    arch: str = "qwen3"
    """Architecture family: qwen3, qwen2 or llama."""
    hidden_size: int = 64
    """Width of the residual stream; num_heads divides it."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Query heads per layer."""
    num_kv_heads: int = 2
    """Key/value heads per layer (GQA); divides num_heads."""
    intermediate_size: int = 128
    """Width of the MLP."""
    max_position_embeddings: int = 4096
    """Longest sequence the model's config admits (the engine's default max_model_len)."""
    tie_word_embeddings: bool = True
    """Share the embedding matrix with the output head."""
    seed: int = 0
    """Seed of the random weights."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown tiny-model arch {self.arch!r}; valid: {', '.join(ARCHS)}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    @property
    def name(self) -> str:
        """Folder name derived from every field (the weights and shapes are a function of them)."""
        tied = "" if self.tie_word_embeddings else "-untied"
        return (f"tiny-{self.arch}-h{self.hidden_size}-l{self.num_layers}-q{self.num_heads}-kv{self.num_kv_heads}"
                f"-i{self.intermediate_size}-p{self.max_position_embeddings}{tied}-s{self.seed}")


SPEC_FIELDS = tuple(f.name for f in fields(TinyModelSpec))


def hf_config(spec: TinyModelSpec, vocab_size: int, eos_token_id: int, initializer_range: float = 0.2, **overrides):
    """The transformers config object (Qwen3Config, Qwen2Config or LlamaConfig) of a tiny model."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}
    kwargs = dict(vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, head_dim=spec.hidden_size // spec.num_heads,
                  max_position_embeddings=spec.max_position_embeddings,
                  tie_word_embeddings=spec.tie_word_embeddings, initializer_range=initializer_range,
                  bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)
    kwargs.update(overrides)
    return classes[spec.arch](**kwargs)


def make_tiny_model(out_dir: str | Path, arch: str | None = None, *, spec: TinyModelSpec | None = None,
                    dtype: torch.dtype = torch.float32, max_shard_size: int | str | None = None,
                    extra_special_tokens: tuple[str, ...] = (), **kwargs) -> Path:
    """Write a random-initialised tiny model with the byte-level tokenizer to ``out_dir``; return the path.

    The shapes and seed come from ``spec``, or from ``arch`` and the ``TinyModelSpec`` fields among
    ``kwargs`` (e.g. ``hidden_size=96``); the other ``kwargs`` go to the transformers config class
    (e.g. ``attention_bias=True``, ``rope_parameters={...}``, ``initializer_range=0.1``). Weights are
    saved as safetensors, sharded when ``max_shard_size`` is given (e.g. ``"100KB"``).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec_kwargs = {k: kwargs.pop(k) for k in SPEC_FIELDS if k in kwargs}
    if spec is None:
        spec = TinyModelSpec(**({"arch": arch} if arch else {}), **spec_kwargs)
    elif arch or spec_kwargs:
        raise ValueError(f"give either spec or arch/{', '.join(spec_kwargs) or 'shape keywords'}, not both")
    tokenizer = build_tokenizer(extra_special_tokens)
    eos = tokenizer.eos_token_id
    config = hf_config(spec, len(tokenizer), eos, **kwargs)
    torch.manual_seed(spec.seed)
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
    for f in fields(TinyModelSpec):
        if f.name != "tie_word_embeddings":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--untied", action="store_true", help="separate lm_head and embedding matrices")
    parser.add_argument("--registers", type=int, default=0, help="add <reg_0>..<reg_{N-1}> special tokens")
    args = parser.parse_args(argv)
    shape = {name: getattr(args, name) for name in SPEC_FIELDS if name != "tie_word_embeddings"}
    spec = TinyModelSpec(**shape, tie_word_embeddings=not args.untied)
    print(make_tiny_model(args.out_dir, spec=spec, extra_special_tokens=tuple(register_tokens(args.registers))))


if __name__ == "__main__":
    main()


# The Qwen3-1.7B shapes (28 layers, 2048 wide, GQA 16/8, head 128, 151,936-token vocabulary): the
# GPU benchmarks' and GPU tests' full-size model, with random weights and the byte tokenizer.
QWEN3_1P7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1_000_000, eos_token_id=256)


def make_qwen3_1p7b(out_dir: str | Path, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                    extra_special_tokens: tuple[str, ...] = ()) -> Path:
    """The Qwen3-1.7B config with random weights (seed 0, built on ``device``) saved with the byte tokenizer
    (and ``extra_special_tokens``, e.g. ``core.pasta.PASTA_TOKENS``: ids 261.. are inside the vocabulary)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_1P7B), dtype=dtype)
    model.save_pretrained(out_dir)
    build_tokenizer(extra_special_tokens).save_pretrained(str(out_dir))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return Path(out_dir)

