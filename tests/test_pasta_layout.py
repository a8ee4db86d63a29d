"""Pasta-Lang layouts (core.pasta.PastaLayout): threads, position ids, forks, the visibility mask,
targets, critical path and malformed pieces.

Expectations are worked out by hand from the rule in DESIGN.md ("Pasta threads") and the thesis'
Pasta-SFT modifications. The tokens are synthetic: letters are plain tokens, the five tags have ids
1000..1004 and a few ids stand for a promise's whole attribute text, so a hand example stays short.
"""

from __future__ import annotations

import random

import pytest
import torch

from sliderl.core.kv_policy import NEVER
from sliderl.core.pasta import DEFAULT_PROMISE_UNITS, PastaLayout, PastaMalformed, PastaTokenIds

TAGS = PastaTokenIds(promise_open=1000, tag_close=1001, async_open=1002, async_close=1003, sync=1004)
PR, CL, AO, AC, SY = 1000, 1001, 1002, 1003, 1004
N1, N2, NO_UNITS = 2001, 2002, 2003  # attribute texts: tokens="1", tokens="2", and one without tokens=
WORDS = {N1: ' topic="x" tokens="1"', N2: ' topic="y" tokens="2"', NO_UNITS: ' topic="z"'}


def decode(ids: list[int]) -> str:
    return "".join(WORDS.get(t, chr(t)) for t in ids)


def text(s: str) -> list[int]:
    return [ord(c) for c in s]


def parse(completion: list[int], prompt_len: int = 2) -> PastaLayout:
    return PastaLayout.parse(prompt_len, completion, TAGS, decode)


# Flattened index: token (thread) position — P = 2 prompt tokens "pq" at 0, 1.
#   2 a (0) 2 | 3 <promise 4 N1 5 /> (0) 3 4 5      fork 1: tokens="1", fork point 5
#   6 <async> 7 b 8 c 9 </async> (1) 6 7 8 9        fork 1 from 5 + 1
#  10 <promise 11 N2 12 /> (0) 16 17 18             main resumes at 5 + 1 + 10·1 = 16; fork 2: tokens="2"
#  13 <async> 14 d 15 </async> (2) 19 20 21
#  16 e (0) 39                                      18 + 1 + 10·2 = 39
#  17 <sync/> (0) 40                                joins forks 1 and 2
#  18 f 19 </async> (0) 41 42                       19: a stray </async> (malformed, plain main token)
#  20 <promise 21 NO_UNITS 22 /> (0) 43 44 45       fork 3: no tokens= -> DEFAULT_PROMISE_UNITS = 3
#  23 <async> 24 g 25 </async> (3) 46 47 48         never joined
#  26 h (0) 76                                      45 + 1 + 10·3 = 76
EXAMPLE = (text("a") + [PR, N1, CL, AO] + text("bc") + [AC, PR, N2, CL, AO] + text("d") + [AC] + text("e")
           + [SY] + text("f") + [AC, PR, NO_UNITS, CL, AO] + text("g") + [AC] + text("h"))


def r(a, b):
    return list(range(a, b))


# catches: a wrong thread for a fork's tags, a dropped or mis-sized position shift after a promise
# (planted: main resuming at position(/>) + 1), the fork's positions not starting after its />, a join
# recorded on the wrong sync, the default units not applied.
def test_hand_worked_threads_positions_and_forks():
    layout = parse(EXAMPLE)
    assert len(layout) == 27 and layout.num_generated == 25
    assert layout.thread.tolist() == [0] * 6 + [1] * 4 + [0] * 3 + [2] * 3 + [0] * 7 + [3] * 3 + [0]
    assert layout.positions.tolist() == r(0, 10) + [16, 17, 18, 19, 20, 21, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 76]
    assert [(f.promise, f.block, f.join, f.units) for f in layout.forks] == [
        ((3, 6), (6, 10), 17, 1), ((10, 13), (13, 16), 17, 2), ((20, 23), (23, 26), None, DEFAULT_PROMISE_UNITS)]
    assert [f.fork_point for f in layout.forks] == [5, 12, 22]
    assert layout.malformed == PastaMalformed(stray_tags=1, promises_without_units=1)
    assert layout.malformed.total == 2


# The expected rows, from the rule: a main query sees the prompt, main tokens before it and forks joined
# by a sync at or before it; a fork query sees the main thread up to its fork point (with the forks
# joined by then) and its own earlier tokens.
EXPECTED_ROWS = {
    **{q: r(0, q + 1) for q in range(0, 6)},  # main before any fork
    **{q: r(0, q + 1) for q in range(6, 10)},  # fork 1: main 0..5 and itself
    **{q: r(0, 6) + r(10, q + 1) for q in range(10, 13)},  # main: not fork 1 (not joined yet)
    **{q: r(0, 6) + r(10, 13) + r(13, q + 1) for q in range(13, 16)},  # fork 2: not fork 1
    16: r(0, 6) + r(10, 13) + [16],  # main after both blocks, before the sync: sees neither fork
    **{q: r(0, q + 1) for q in range(17, 23)},  # the sync and after: forks 1 and 2 joined
    **{q: r(0, q + 1) for q in range(23, 26)},  # fork 3: main up to 22 (forks 1, 2 joined) and itself
    26: r(0, 23) + [26],  # fork 3 never joined
}


# catches: main seeing a fork before its sync (planted: exposed_at = the key's own index for fork
# tokens -> rows 16 and 12 differ), a fork seeing a sibling that was not joined at its fork point,
# a fork not seeing its own fork point, the sync token itself not seeing the joined forks.
def test_dense_mask_follows_the_rule_by_hand():
    layout = parse(EXAMPLE)
    expected = torch.zeros(27, 27, dtype=torch.bool)
    for q, keys in EXPECTED_ROWS.items():
        expected[q, keys] = True
    assert torch.equal(layout.dense_mask(), expected)
    q = torch.arange(27)
    assert torch.equal(layout.mask_mod()(0, 0, q[:, None], q[None, :]), expected)
    assert layout.exposed_at().tolist() == r(0, 6) + [17] * 4 + r(10, 13) + [17] * 3 + r(16, 23) + [NEVER] * 3 + [26]
    assert layout.view_at().tolist() == r(0, 6) + [5] * 4 + r(10, 13) + [12] * 3 + r(16, 23) + [22] * 3 + [26]


# catches: the promise's /> still predicting <async> (planted: predictor = the flattened predecessor
# -> completion index 8 (flattened 10) would be predicted by 9, not 5), a fork's first token predicted
# by the /> instead of its <async>, the <async> left in the targets.
def test_targets_follow_each_thread():
    layout = parse(EXAMPLE)
    # completion index j = flattened index j + 2; the predictor is the previous token of the same thread:
    # main after fork 1's block (10) <- its /> (5); fork 1's b (7) <- <async> (6); e (16) <- /> of
    # fork 2 (12); h (26) <- /> of fork 3 (22); each <async> (6, 13, 23) <- the token before it.
    expected = [1, 2, 3, 4, 5, 6, 7, 8, 5, 10, 11, 12, 13, 14, 12, 16, 17, 18, 19, 20, 21, 22, 23, 24, 22]
    assert layout.predictor_index().tolist() == expected
    mask = [True] * 25
    for flat in (6, 13, 23):  # the <async> tokens
        mask[flat - 2] = False
    assert layout.target_mask().tolist() == mask


# catches: forks costing main-thread steps, a sync not waiting for its forks, the end not waiting for a
# fork never joined, the <async> not costing a step on its fork.
def test_critical_path_and_speedup_by_hand():
    layout = parse(EXAMPLE)
    # main steps: a=1, promise 2..4 (fork 1 runs steps 5..8), promise 5..7 (fork 2: 8..10), e=8,
    # sync=9 -> waits to 10, f=11, </async>=12, promise 13..15 (fork 3: 16..18), h=16; end = max(16, 18)
    assert layout.critical_path == 18
    assert layout.speedup(36) == 2.0
    plain = parse(text("abcdefgh"))
    assert plain.critical_path == 8 and plain.forks == () and plain.malformed.total == 0
    assert plain.positions.tolist() == r(0, 10) and plain.dense_mask().equal(torch.ones(10, 10).tril().bool())


# Each malformed piece, worked by hand: (completion, threads of the completion, positions of the
# completion, counts). P = 2, so the completion starts at position 2.
MALFORMED = {
    # an <async> block without a promise: plain main tokens; the <async> and its </async> are stray
    "block without promise": (text("a") + [AO] + text("b") + [AC], [0] * 4, r(2, 6), PastaMalformed(stray_tags=2)),
    # a promise followed by text: forks nothing, no position shift
    "promise without block": ([PR, N1, CL] + text("b"), [0] * 4, r(2, 6), PastaMalformed(promises_without_block=1)),
    # a promise at the very end: no block either
    "promise at the end": ([PR, N1, CL], [0] * 3, r(2, 5), PastaMalformed(promises_without_block=1)),
    # <promise interrupted by <sync/> (no fork to join: an ordinary token) before its />
    "promise never closed": ([PR, N1, SY] + text("b"), [0] * 4, r(2, 6), PastaMalformed(unclosed_promises=1)),
    # a promise inside a fork: plain fork text (<promise, /> and <async> each stray), the fork ends at
    # its first </async>; the second </async> is stray on the main thread, which resumes at 4 + 1 + 10
    "nested promise": ([PR, N1, CL, AO, PR, N2, CL, AO] + text("c") + [AC, AC], [0] * 3 + [1] * 7 + [0],
                       r(2, 12) + [15], PastaMalformed(stray_tags=4)),
    # a fork never closed: ends at the end of the text
    "unclosed fork": ([PR, N2, CL, AO] + text("bc"), [0] * 3 + [1] * 3, r(2, 8), PastaMalformed(unclosed_forks=1)),
    # a stray /> and a <sync/> with no fork: plain main tokens, the sync not counted
    "stray close, idle sync": ([CL, SY] + text("b"), [0] * 3, r(2, 5), PastaMalformed(stray_tags=1)),
}


# catches: a malformed piece that forks or shifts positions anyway, a nested promise that forks (the
# one-level decision), a count missing or doubled.
@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_pieces_are_plain_and_counted(case):
    completion, threads, positions, counts = MALFORMED[case]
    layout = parse(completion)
    assert layout.thread.tolist()[2:] == threads
    assert layout.positions.tolist()[2:] == positions
    assert layout.malformed == counts


def test_unclosed_fork_is_never_joined_and_ends_the_critical_path():
    # catches: a fork still open at the end given a join or dropped from the critical path
    layout = parse([PR, N2, CL, AO] + text("bcdefg") + [SY])  # the sync is fork text: the fork never closed
    assert layout.forks[0].block == (5, 13) and layout.forks[0].join is None
    assert layout.critical_path == 3 + 8  # the promise (3 steps), then 8 block tokens on the fork


# catches: bad input failing late or silently (a prompt-less layout, whose first target has no
# predictor; a negative baseline; a division by a zero critical path)
def test_bad_input_is_named():
    with pytest.raises(ValueError, match="prompt_len must be an int >= 1.*got 0"):
        PastaLayout.parse(0, text("a"), TAGS, decode)
    with pytest.raises(ValueError, match="baseline_len must be >= 0 tokens, got -1"):
        parse(text("a")).speedup(-1)
    with pytest.raises(ValueError, match="empty response has no critical path"):
        parse([]).speedup(10)


# ---- the comparison rule (mask_mod) against the table rule (dense_mask) on many random layouts ----

def random_completion(rng: random.Random) -> list[int]:
    """Mostly well-formed pieces (promise + block, syncs, text) with malformed ones mixed in."""
    out: list[int] = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.choice(["text", "fork", "fork", "sync", "soup", "promise"])
        if kind == "text":
            out += text("abc"[:rng.randint(1, 3)])
        elif kind == "fork":
            body = [rng.choice([ord("x"), ord("y"), PR, CL, AO, SY]) for _ in range(rng.randint(0, 4))]
            out += [PR, rng.choice([N1, N2, NO_UNITS]), CL, AO, *body] + ([AC] if rng.random() < 0.9 else [])
        elif kind == "sync":
            out.append(SY)
        elif kind == "promise":
            out += [PR, rng.choice([N1, N2])] + ([CL] if rng.random() < 0.5 else [])
        else:
            out += [rng.choice([PR, CL, AO, AC, SY, ord("z")]) for _ in range(rng.randint(1, 4))]
    return out


# catches: any disagreement between the comparisons a FlexAttention mask_mod evaluates and the tables
# (planted: a fork's view_at at its <promise instead of its /> -> fails; exposed_at never for every
# fork -> fails), and a mask that is not causal in flattened order.
def test_mask_mod_equals_the_table_rule_on_random_layouts():
    rng = random.Random(0)
    forks = joins = 0
    for _ in range(300):
        layout = parse(random_completion(rng), prompt_len=rng.randint(1, 3))
        dense = layout.dense_mask()
        q = torch.arange(len(layout))
        assert torch.equal(layout.mask_mod()(0, 0, q[:, None], q[None, :]), dense)
        assert torch.equal(dense, dense.tril()) and bool(dense.diagonal().all())
        forks += len(layout.forks)
        joins += sum(f.join is not None for f in layout.forks)
    assert forks > 300 and joins > 100  # the random layouts do exercise forks and joins
