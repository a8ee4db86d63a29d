"""Which decoding mode (``rollout.mode``) an engine runs, by its KV policy's kind: ``pasta`` runs Pasta-Lang's
threads (``rollout.pasta``), ``last_k`` and ``summary`` restart their contexts (``rollout.restart``); every other
policy decodes plainly. A new mode registers here."""

from __future__ import annotations

from sliderl.rollout.mode import DecodingMode, EngineContext
from sliderl.rollout.pasta.runtime import PastaRuntime
from sliderl.rollout.restart.mode import LastKMode, SummaryMode

MODES: dict[str, type[DecodingMode]] = {"pasta": PastaRuntime, "last_k": LastKMode, "summary": SummaryMode}


def make_mode(context: EngineContext, args) -> DecodingMode:
    """The mode for ``context.policy`` (``args``: the engine's ``EngineArgs``)."""
    return MODES.get(context.policy.kind, DecodingMode)(context, args)
