"""The two ways a job stops on the user's side: a bad config (before Ray starts) or a run that cannot go on."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config the user wrote (file, override or value) is invalid; the message says how."""


class RunError(RuntimeError):
    """The run cannot continue; its checkpoints and trace log are left intact."""


def actor_death(err: BaseException) -> str:
    """One line saying why a Ray actor is gone. An actor whose ``__init__`` raised carries that exception's
    traceback, whose last line names it ("ValueError: ..."): that line, whole, rather than the first 300
    characters of the traceback (which cut it off); any other death its message's first 300 characters."""
    text = str(err)
    if getattr(err, "actor_init_failed", False):
        last = [line.strip() for line in text.splitlines() if line.strip()]
        if last:
            return f"its __init__ raised {last[-1]}"
    return " ".join(text.split())[:300]
