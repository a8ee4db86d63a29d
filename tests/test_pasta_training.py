"""Pasta traces in the trainer: the Learner's path scores them under their threads (Pasta-SFT's three
modifications: the mask, the position ids, each token predicted within its thread).

The independent reference: the response is built here from labelled pieces, so each token's thread,
position id, predictor and the mask follow from the construction and the rule as DESIGN.md states it
(written out below without core.pasta), then a float64 dense forward of the same weights scores it.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from sliderl.core.loader import load_model, load_tokenizer
from sliderl.core.model import DenseAttention
from sliderl.core.pasta import DEFAULT_PROMISE_UNITS, PASTA_TOKENS, UNIT, PastaLayout, PastaTokenIds
from sliderl.core.trace import Trace
from sliderl.core.vocab import bind_policy_vocab
from sliderl.trainer.algorithms import SFTOptions
from sliderl.trainer.attention import FlexPolicyAttention, training_attention
from sliderl.trainer.learner import Learner
from sliderl.trainer.logprobs import WindowInput, pack_windows, packed_logprobs, recompute_logprobs, window_input
from sliderl.trainer.windows import full_window, truncated_window

PROMPT = "Q: two chains\n"


class Reference:
    """A completion built from labelled pieces, with what the rule says about each of its tokens."""

    def __init__(self, tok, prompt_len: int):
        self.tok, self.tags = tok, PastaTokenIds.from_tokenizer(tok)
        self.p = prompt_len
        self.ids: list[int] = []
        self.thread: list[int] = [0] * prompt_len  # per flattened index
        self.positions: list[int] = list(range(prompt_len))
        self.fork_point: dict[int, int] = {}  # fork -> flattened index of its promise's />
        self.join: dict[int, int] = {}  # fork -> flattened index of the sync that joins it
        self.main_next = prompt_len
        self.pending: list[int] = []  # forks not yet joined

    def _add(self, token: int, thread: int, position: int) -> int:
        self.ids.append(token)
        self.thread.append(thread)
        self.positions.append(position)
        return self.p + len(self.ids) - 1

    def main(self, token_ids: list[int]) -> None:
        for t in token_ids:
            self._add(t, 0, self.main_next)
            self.main_next += 1

    def text(self, s: str) -> None:
        self.main(self.tok(s).input_ids)

    def fork(self, attributes: str, units: int, body: str) -> None:
        """A promise on the main thread, then its block; the main thread resumes UNIT·units after the />."""
        self.main([self.tags.promise_open, *self.tok(attributes).input_ids, self.tags.tag_close])
        f = len(self.fork_point) + 1
        self.fork_point[f] = self.p + len(self.ids) - 1
        at = self.positions[-1] + 1
        for t in [self.tags.async_open, *self.tok(body).input_ids, self.tags.async_close]:
            self._add(t, f, at)
            at += 1
        self.main_next = self.positions[self.fork_point[f]] + 1 + UNIT * units
        self.pending.append(f)

    def sync(self) -> None:
        self.main([self.tags.sync])
        for f in self.pending:
            self.join[f] = self.p + len(self.ids) - 1
        self.pending = []

    def mask(self) -> torch.Tensor:
        """DESIGN.md: k is visible to q iff k is in q's thread (earlier or itself), or in q's ancestor thread
        (main) at or before q's fork point, or in a fork joined by a sync that q's thread has passed (a
        fork has passed what the main thread had passed at its fork point)."""
        n = len(self.thread)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for q in range(n):
            tq = self.thread[q]
            passed = q if tq == 0 else self.fork_point[tq]
            for k in range(q + 1):
                tk = self.thread[k]
                own = tk == tq
                ancestor = tq != 0 and tk == 0 and k <= self.fork_point[tq]
                joined = tk != 0 and tk in self.join and self.join[tk] <= passed
                mask[q, k] = own or ancestor or joined
        return mask

    def predictors(self) -> list[int | None]:
        """For each completion token, the previous token of its thread; None for a fork's <async>."""
        out, last = [], {0: self.p - 1}
        for i in range(self.p, len(self.thread)):
            t = self.thread[i]
            out.append(last.get(t))
            last[t] = i
        return out


def build(tok, prompt_len: int) -> Reference:
    """Two forks joined by a sync, main tokens after the join, a stray </async> (malformed), a third fork
    whose promise has no tokens= (malformed: default units) that is never joined."""
    ref = Reference(tok, prompt_len)
    ref.text("ab")
    ref.fork(' topic="A" tokens="1"', 1, "x+1=")
    ref.fork(' topic="B" tokens="2"', 2, "y*2")
    ref.text("c")
    ref.sync()
    ref.text("de")
    ref.main([ref.tags.async_close])
    ref.fork(' topic="C"', DEFAULT_PROMISE_UNITS, "uv")
    ref.text("f")
    ref.main([tok.eos_token_id])
    return ref


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3", extra_special_tokens=PASTA_TOKENS)
    tok = load_tokenizer(path)
    prompt = tok(PROMPT).input_ids
    ref = build(tok, len(prompt))
    return path, tok, prompt, ref


def reference_logprobs(path, prompt, ref) -> torch.Tensor:
    """float64 dense forward under the reference mask and positions; each completion token scored by the
    logits of its thread predecessor; NaN where the token is no target (a fork's <async>)."""
    model = load_model(path).double()
    ids = torch.tensor(prompt + ref.ids)
    with torch.no_grad():
        hidden = model(ids, torch.tensor(ref.positions), DenseAttention(ref.mask()))
        logp = model.compute_logits(hidden).double().log_softmax(-1)
    out = torch.full((len(ref.ids),), math.nan, dtype=torch.float64)
    for j, pred in enumerate(ref.predictors()):
        if pred is not None:
            out[j] = logp[pred, ref.ids[j]]
    return out


def layout_of(tok, prompt, ref) -> PastaLayout:
    return PastaLayout.parse(len(prompt), ref.ids, PastaTokenIds.from_tokenizer(tok), tok.decode)


# catches: the trainer's mask letting the main thread see a fork before its sync (planted in
# PastaLayout.exposed_at), the position shift dropped (planted in the parser), the promise's />
# scoring <async> instead of the main continuation (planted in PastaLayout.predictor_index), the
# layout's position ids not reaching the model (planted in pack_windows: RoPE at trace indices).
@pytest.mark.parametrize("backend", ["sdpa", "dense"])
def test_learner_path_logprobs_match_a_float64_reference(setup, backend):
    path, tok, prompt, ref = setup
    expected = reference_logprobs(path, prompt, ref)
    targets = ~torch.isnan(expected)
    assert int((~targets).sum()) == 3  # the three <async>
    layout = layout_of(tok, prompt, ref)
    assert len(layout.forks) == 3 and layout.malformed.total == 2
    model = load_model(path)
    policy = bind_policy_vocab("pasta", tok, model)
    with torch.no_grad():
        got = recompute_logprobs(model, prompt, ref.ids, policy, layout=layout, backend=backend)
    assert got.shape == (len(ref.ids),)
    assert (got.double()[targets] - expected[targets]).abs().max() < 1e-4


# catches: the Learner not parsing the layout for a pasta trace (evaluating it as plain causal text),
# or putting a loss on a fork's <async>.
def test_learner_evaluates_a_pasta_trace_under_its_threads(setup):
    path, tok, prompt, ref = setup
    expected = reference_logprobs(path, prompt, ref)
    targets = ~torch.isnan(expected)
    learner = Learner(str(path), algo=SFTOptions(), window_mode="full")
    trace = Trace("t0", "g0", "p0", -1, 0, "pasta", prompt, ref.ids, [], "stop")
    result = learner.evaluate([[trace]])
    assert abs(result.loss - float(-expected[targets].mean())) < 1e-4


# catches: a pack of pasta and plain windows where the plain ones inherit threads, or the per-document
# batch (taken when many similar documents share a pack) dropping the thread rule.
def test_pasta_and_plain_windows_pack_together(setup):
    path, tok, prompt, ref = setup
    model = load_model(path)
    pasta = bind_policy_vocab("pasta", tok, model)
    full = bind_policy_vocab("full", tok, model)
    layout = layout_of(tok, prompt, ref)
    items = [window_input(prompt, ref.ids, pasta, 1.0, layout=layout), window_input(prompt, ref.ids, full, 1.0)] * 2
    with torch.no_grad():
        alone = [packed_logprobs(model, pack_windows([item]), "sdpa") for item in items[:2]]
        packed = pack_windows(items)
        assert training_attention(packed.visibility, "cpu", "sdpa").documents is not None  # the per-document path
        together = packed.split(packed_logprobs(model, packed, "sdpa"))
    for got, want in zip(together, alone * 2):
        assert (got - want).abs().max() < 1e-5
    assert (alone[0] - alone[1]).abs().max() > 1e-2  # the threads do change the scores


# catches: FlexAttention's mask_mod disagreeing with the reference mask for a pasta window.
def test_flex_mask_mod_matches_the_reference_mask(setup):
    path, tok, prompt, ref = setup
    pasta = bind_policy_vocab("pasta", tok)
    item = window_input(prompt, ref.ids, pasta, 1.0, layout=layout_of(tok, prompt, ref))
    vis = pack_windows([item]).visibility
    n = len(vis)
    mask = ref.mask()[:n, :n]  # the inputs: every token but the last
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 8, generator=gen) for h in (4, 2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = FlexPolicyAttention(vis, compiled=False)(0, q, k, v)
    want = DenseAttention(mask)(0, q.double(), k.double(), v.double())
    assert (out.double() - want).abs().max() < 1e-5


# catches: a pasta trace silently cut into truncated/chunked windows (its forks' keys would be cut
# away), or scored without its layout.
def test_pasta_traces_train_whole_only(setup):
    path, tok, prompt, ref = setup
    learner = Learner(str(path), algo=SFTOptions(), window_mode="truncated", window=8)
    trace = Trace("t0", "g0", "p0", -1, 0, "pasta", prompt, ref.ids, [], "stop")
    with pytest.raises(ValueError, match=r"window_mode='truncated' is not valid for it; set window_mode='full'"):
        learner.step([[trace]])
    pasta = bind_policy_vocab("pasta", tok)
    with pytest.raises(ValueError, match="PastaLayout is required for the pasta policy"):
        window_input(prompt, ref.ids, pasta, 1.0)
    layout = layout_of(tok, prompt, ref)
    ids = torch.tensor(prompt + ref.ids)
    with pytest.raises(ValueError, match=r"whole trace only \(window_mode='full'.*targets \[\d+, \d+\)"):
        WindowInput(ids, torch.zeros_like(ids), truncated_window(len(prompt), len(ref.ids), 4, 2), 1.0, layout)
    assert WindowInput(ids, torch.zeros_like(ids), full_window(len(prompt), len(ref.ids)), 1.0, layout)


# catches: the promise's /> keeping <async> as its target in the SFT path (planted in
# PastaLayout.predictor_index: the flattened predecessor -> the pair (/>, <async>) is in the loss and
# (/>, c) is gone), the <async> in the loss, the eos or the sync left without a target.
def test_sft_targets_by_hand(setup):
    from sliderl.trainer.sft import SFTExample, sft_trace

    path, tok, _, _ = setup
    trace = sft_trace(tok, SFTExample("Q\n", 'a<promise tokens="1"/><async>b</async>c<sync/>d'), "pasta", 0)
    # flattened: 0 Q, 1 \n, 2 a, 3 <promise, 4..14 ' tokens="1"' (11 bytes), 15 />, 16 <async>, 17 b,
    # 18 </async>, 19 c, 20 <sync/>, 21 d, 22 eos. Trained (input -> target) pairs, by target:
    #   \n->a, a-><promise, <promise->' ', the attribute bytes in turn, '"'->/>, (no pair for <async>),
    #   <async>->b, b-></async>, />->c (not <async>), c-><sync/>, <sync/>->d, d->eos
    promise, close, async_open, async_close, sync = (tok.convert_tokens_to_ids(t) for t in PASTA_TOKENS)
    attr = tok(' tokens="1"').input_ids
    a, b, c, d = (tok(ch).input_ids[0] for ch in "abcd")
    nl, eos = tok("\n").input_ids[0], tok.eos_token_id
    expected = ([(nl, a), (a, promise), (promise, attr[0])] + list(zip(attr, attr[1:])) + [(attr[-1], close)]
                + [(async_open, b), (b, async_close), (close, c), (c, sync), (sync, d), (d, eos)])
    layout = PastaLayout.parse(2, trace.completion_token_ids, PastaTokenIds.from_tokenizer(tok), tok.decode)
    item = window_input(trace.prompt_token_ids, trace.completion_token_ids, bind_policy_vocab("pasta", tok),
                        1.0, layout=layout)
    packed, mask = pack_windows([item]), item.loss_mask()
    pairs = [(int(packed.input_ids[p]), int(t)) for p, t, m in zip(packed.predictor_index, packed.target_ids, mask)
             if m]
    assert pairs == expected
    # c (flattened 19) sits after the promise's predicted 10 tokens: position 15 + 1 + 10 = 26
    assert packed.positions.tolist()[15:22] == [15, 16, 17, 18, 26, 27, 28]
