"""The two ways a job stops on the user's side: a bad config (before Ray starts) or a run that cannot go on."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config the user wrote (file, override or value) is invalid; the message says how."""


class RunError(RuntimeError):
    """The run cannot continue; its checkpoints and trace log are left intact."""
