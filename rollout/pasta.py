"""Pasta-Lang as tokens: what the engine's runtime and the trainer agree on (thesis, Pasta chapter).

A response annotated in Pasta-Lang is one *flattened* token sequence, the layout the runtime outputs
and the trainer reads:

    ... main ... <promise topic="t" tokens="N"/> <async> ... fork ... </async> ... main ... <sync/> ...

- ``<promise`` opens a promise tag; the tag's attribute text follows as ordinary tokens and ``/>``
  closes it. The promise's *predicted length* is 10·N tokens (``tokens="N"``); a promise without a
  valid ``tokens`` attribute gets ``DEFAULT_PROMISE_UNITS`` (and is counted as malformed).
- Decoding the ``/>`` that closes a promise forks a thread. The runtime appends ``<async>`` to the
  fork (the model does not sample it); the fork decodes until ``</async>``. In the flattened layout
  each fork's ``<async> … </async>`` block sits right after its promise, then the main thread's
  continuation follows.
- ``<sync/>`` makes the main thread wait until all its forks have ended; from then on it sees them.

These strings are special tokens of every tokenizer that runs Pasta (``PASTA_TOKENS``; the tiny
byte tokenizer gains them with ``rollout.tiny.build_tokenizer(extra_special_tokens=PASTA_TOKENS)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PROMISE_OPEN = "<promise"
TAG_CLOSE = "/>"
ASYNC_OPEN = "<async>"
ASYNC_CLOSE = "</async>"
SYNC = "<sync/>"
PASTA_TOKENS = (PROMISE_OPEN, TAG_CLOSE, ASYNC_OPEN, ASYNC_CLOSE, SYNC)

UNIT = 10  # a promise's tokens="N" predicts 10·N tokens (the thesis)
DEFAULT_PROMISE_UNITS = 3  # predicted 30 tokens when the attribute is missing or invalid

_TOKENS_ATTR = re.compile(r'\btokens\s*=\s*"(\d{1,6})"')


def promise_units(attributes: str) -> int | None:
    """``N`` of ``tokens="N"`` in a promise tag's attribute text, or None when absent/invalid."""
    match = _TOKENS_ATTR.search(attributes)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class PastaTokenIds:
    """The five tag token ids of one tokenizer."""

    promise_open: int
    tag_close: int
    async_open: int
    async_close: int
    sync: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> PastaTokenIds:
        """Look the tags up; a tokenizer without them is an error naming the missing ones."""
        vocab = tokenizer.get_vocab()
        missing = [t for t in PASTA_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer has no Pasta-Lang tokens {missing}; add {list(PASTA_TOKENS)} as special "
                             "tokens (rollout.tiny.build_tokenizer(extra_special_tokens=rollout.pasta.PASTA_TOKENS))")
        return cls(*(vocab[t] for t in PASTA_TOKENS))
