"""What a finished request under a restart policy reports beside its tokens: its restarts."""

from __future__ import annotations

from dataclasses import dataclass, field

from sliderl.core.restart import Restart
from sliderl.rollout.sequence import RequestOutput


@dataclass
class RestartRequestOutput(RequestOutput):
    """A finished request under ``last_k`` or ``summary``: ``token_ids`` is every generated token, segment after
    segment (summary calls included), ``restarts`` each restart with the context the next segment started from.
    The summary call's forced opening and closing are marked ``forced`` (never trained)."""

    restarts: list[Restart] = field(default_factory=list)

    @property
    def reencoded_tokens(self) -> int:
        """Tokens encoded again at the restarts (the new contexts past their kept prompt)."""
        return sum(len(r.context_tail) for r in self.restarts)
