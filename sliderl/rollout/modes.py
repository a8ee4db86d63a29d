"""Which decoding mode (``rollout.mode``) an engine runs, by its KV policy's kind: ``pasta`` runs Pasta-Lang's
threads (``rollout.pasta``), ``last_k`` and ``summary`` restart their contexts (``rollout.restart``),
``planned_diffusion`` plans and denoises spans (``rollout.planned_diffusion``); every other policy decodes plainly.
A new mode registers here."""

from __future__ import annotations

from sliderl.core.kv_policy import KVPolicy
from sliderl.rollout.block_bound import block_bound
from sliderl.rollout.mode import DecodingMode, EngineContext
from sliderl.rollout.pasta.request import pasta_block_bound
from sliderl.rollout.pasta.runtime import PastaRuntime
from sliderl.rollout.planned_diffusion.runtime import PDRuntime
from sliderl.rollout.restart.mode import LastKMode, SummaryMode

MODES: dict[str, type[DecodingMode]] = {"pasta": PastaRuntime, "last_k": LastKMode, "summary": SummaryMode,
                                        "planned_diffusion": PDRuntime}


def make_mode(context: EngineContext, args) -> DecodingMode:
    """The mode for ``context.policy`` (``args``: the engine's ``EngineArgs``)."""
    return MODES.get(context.policy.kind, DecodingMode)(context, args)


def request_block_bound(args, prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """The blocks an engine built from ``args`` (``EngineArgs``) reserves for one request: its decoding mode's bound
    (``rollout.modes``: Pasta's threads under kv=pasta, else ``block_bound``), without building the engine."""
    policy = KVPolicy.parse(args.kv)
    if policy.kind == "pasta":
        return pasta_block_bound(prompt_len, max_tokens, max_model_len, args.block_size, args.pasta_max_forks)
    return block_bound(policy, prompt_len, max_tokens, max_model_len, args.block_size, args.max_num_batched_tokens)
