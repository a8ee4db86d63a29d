"""Which decoding mode (``rollout.mode``) an engine runs, by its KV policy's kind: ``pasta`` runs Pasta-Lang's
threads (``rollout.pasta``), ``planned_diffusion`` plans and denoises spans (``rollout.planned_diffusion``); every
other policy decodes plainly. A new mode registers here."""

from __future__ import annotations

from sliderl.rollout.mode import DecodingMode, EngineContext
from sliderl.rollout.pasta.runtime import PastaRuntime
from sliderl.rollout.planned_diffusion.runtime import PDRuntime

MODES: dict[str, type[DecodingMode]] = {"pasta": PastaRuntime, "planned_diffusion": PDRuntime}


def make_mode(context: EngineContext, args) -> DecodingMode:
    """The mode for ``context.policy`` (``args``: the engine's ``EngineArgs``)."""
    return MODES.get(context.policy.kind, DecodingMode)(context, args)
