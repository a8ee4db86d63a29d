"""Bind a KV policy to a tokenizer and grow the model's vocabulary to match: one function for the
engine and the learner, so both give ``<reg_i>`` (and Pasta-Lang's tags, Planned Diffusion's tokens) the same ids
and the same mean-initialised rows."""

from __future__ import annotations

from sliderl.core.kv_policy import KVPolicy, register_tokens
from sliderl.core.model import DecoderLM
from sliderl.core.pasta import PASTA_TOKENS
from sliderl.core.restart import RESTART_TOKENS
from sliderl.core.planned_diffusion import PD_TOKENS

END_THINK = "</think>"


def policy_tokens(policy: KVPolicy | str) -> list[str]:
    """The tokens ``policy`` adds to a vocabulary: registers:N's ``<reg_i>``, pasta's tags, summary's tool call
    (``<tool_call>``, ``</tool_call>``), planned_diffusion's tags with ``<mask>`` and ``<null>``, none for the
    others."""
    policy = KVPolicy.parse(policy)
    return {"registers": register_tokens(policy.num_registers), "pasta": list(PASTA_TOKENS),
            "summary": list(RESTART_TOKENS), "planned_diffusion": list(PD_TOKENS)}.get(policy.kind, [])


def bind_policy_vocab(policy: KVPolicy | str, tokenizer, model: DecoderLM | None = None) -> KVPolicy:
    """The policy bound to ``tokenizer``'s ids, adding what the policy needs.

    Every policy gets the end-of-thinking id (``</think>``, None when the tokenizer lacks it). The
    registers policy adds missing ``<reg_0> … <reg_{N-1}>`` to the tokenizer as special tokens, in
    order, and binds their ids; the pasta policy adds the missing Pasta-Lang tags (``PASTA_TOKENS``), the summary
    policy its tool call's tokens (``core.restart.RESTART_TOKENS``), planned_diffusion the Pasta tags and ``<mask>``,
    ``<null>`` (``PD_TOKENS``).
    Then, when the tokenizer has outgrown ``model``'s vocabulary, the model grows with
    ``DecoderLM.resize_vocab`` (new rows = mean row, deterministic).
    """
    policy = KVPolicy.parse(policy)
    vocab = tokenizer.get_vocab()
    end_think = vocab.get(END_THINK)
    missing = [t for t in policy_tokens(policy) if t not in vocab]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    if policy.kind == "registers":
        policy = policy.bind(tokenizer.convert_tokens_to_ids(register_tokens(policy.num_registers)), end_think)
    else:
        policy = policy.bind(end_think_id=end_think)
    if model is not None and len(tokenizer) > model.config.vocab_size:
        model.resize_vocab(len(tokenizer))
    return policy
