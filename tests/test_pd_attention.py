"""Planned Diffusion's attention, against a dense reference built here from DESIGN.md's rule ("Planned Diffusion
spans"): plan and context causally; a span token sees context, plan (through its own promise: its own item is the
last it sees, core.planned_diffusion says why) and every token of its own span (both directions), never another
span before the sync; after the sync everything.

The response is built from labelled pieces (what each token is follows from the construction, without
core.planned_diffusion), the mask is the rule written out token pair by token pair, and a float64 dense forward
of the same weights under that mask is the reference for both sides that must obey it:

- the learner's training stream (the clean response, then a noised copy of every span: a copy sees what its
  span sees, its own copy in both directions, never the clean span it copies, and nothing clean sees a copy);
- the runtime's denoising forward (a span over the engine's cached context and plan) and what autoregression
  sees after the commit and the sync.

Planted bugs each test was run against (each failed it): a span sees another span (exposed_at of a span token =
its round's plan end; in the runtime, SpanBatch.mask ignoring span ids); a span token attends causally only
(write_at of a span token = its own index; in the runtime, the own-span mask kept lower-triangular); plan tokens
see a span before the sync (exposed_at of a span token = its span's end, so the plan after a round never synced
sees it; the noised copies exposed at their round's sync, so the next round's plan sees them); a span sees the
plan past its own promise (Round.view = the plan's end; in the runtime, every span's view the plan's end).
"""

from __future__ import annotations

import pytest
import torch

from sliderl.core.loader import load_model, load_tokenizer
from sliderl.core.model import DenseAttention
from sliderl.core.planned_diffusion import PD_TOKENS, NoisedLayout, PDLayout, PDTokenIds, SpanNoise
from sliderl.core.vocab import bind_policy_vocab
from sliderl.rollout.model_runner import ModelRunner
from sliderl.rollout.planned_diffusion import span_graphs
from sliderl.rollout.planned_diffusion.span_attention import SpanAttention, SpanBatch
from sliderl.rollout.planned_diffusion.span_graphs import SpanGraphs, bucket_of
from sliderl.trainer.logprobs import pack_windows, recompute_logprobs, window_input

PROMPT = "Q: chains\n"


class Reference:
    """A completion built from labelled pieces: each token's span (0: autoregressive) and each span's round."""

    def __init__(self, tok, prompt_len: int):
        self.tok, self.tags = tok, PDTokenIds.from_tokenizer(tok)
        self.p = prompt_len
        self.ids: list[int] = []
        self.span: list[int] = [0] * prompt_len  # per flattened index
        self.round_of: dict[int, int] = {}  # span -> round
        self.first: dict[int, int] = {}  # round -> flattened index of its first span token
        self.sync: dict[int, int] = {}  # round -> flattened index of its <sync/>
        self.body: list[int] = []  # flattened indices of span body tokens
        self.rounds = 0
        self.promises: list[int] = []  # the current plan's />, flattened indices
        self.view: dict[int, int] = {}  # span -> its promise's />

    def _add(self, tokens: list[int], span: int = 0) -> None:
        self.ids += tokens
        self.span += [span] * len(tokens)

    def text(self, s: str) -> None:
        self._add(self.tok(s, add_special_tokens=False).input_ids)

    def plan(self, *units: int) -> None:
        self.promises = []
        for n in units:
            self.text(f'<promise topic="t" tokens="{n}"/>')
            self.promises.append(self.p + len(self.ids) - 1)

    def spans(self, *bodies: list[int]) -> None:
        """A round's spans (bodies of UNIT·N tokens each, the plan's lengths); its sync is separate."""
        self.rounds += 1
        self.first[self.rounds] = self.p + len(self.ids)
        for k, body in enumerate(bodies):
            s = max(self.span) + 1
            self.round_of[s] = self.rounds
            self.view[s] = self.promises[k]
            start = self.p + len(self.ids) + 1
            self._add([self.tags.async_open, *body, self.tags.async_close], s)
            self.body += range(start, start + len(body))

    def close(self) -> None:
        self.sync[self.rounds] = self.p + len(self.ids)
        self._add([self.tags.sync])

    def visible(self, q: int, k: int) -> bool:
        """The rule, for flattened indices."""
        sq, sk = self.span[q], self.span[k]
        if sq and sq == sk:
            return True  # its own span, both directions
        history = q if sq == 0 else self.view[sq]  # the last autoregressive token q has seen
        if sk:
            sync = self.sync.get(self.round_of[sk])
            return sync is not None and sync <= history
        return k <= history

    def mask(self) -> torch.Tensor:
        n = len(self.span)
        return torch.tensor([[self.visible(q, k) for k in range(n)] for q in range(n)])


def body(tok, text: str, length: int) -> list[int]:
    ids = tok(text, add_special_tokens=False).input_ids
    return ids + [tok.convert_tokens_to_ids("<null>")] * (length - len(ids))


def build(tok, prompt_len: int) -> Reference:
    """Two rounds synced (the second sees the first's spans), then a round never synced (a plan follows it: the
    response was cut), so nothing after it sees its span."""
    ref = Reference(tok, prompt_len)
    ref.text("ab")
    ref.plan(1, 2)
    ref.spans(body(tok, "x+1=2", 10), body(tok, "y*2=14 ok", 20))
    ref.close()
    ref.text("c")
    ref.plan(1)
    ref.spans(body(tok, "z-1", 10))
    ref.close()
    ref.text("d")
    ref.plan(1)
    ref.spans(body(tok, "w", 10))
    ref.plan(1)  # no sync: this plan must not see the span before it
    ref.text("e")
    ref._add([tok.eos_token_id])
    return ref


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3", extra_special_tokens=PD_TOKENS)
    tok = load_tokenizer(path)
    prompt = tok(PROMPT).input_ids
    return path, tok, prompt, build(tok, len(prompt))


def noise_of(ref: Reference, layout: PDLayout) -> SpanNoise:
    """Every other body token masked (a fixed draw), t = 0.5."""
    masked = torch.zeros(len(layout), dtype=torch.bool)
    masked[ref.body[::2]] = True
    return SpanNoise(0.5, masked)


def stream_reference(ref: Reference) -> tuple[list[int], torch.Tensor]:
    """The learner's stream as flattened indices (clean inputs, then every span copied) and its mask."""
    n = len(ref.span)
    copies = [i for i in range(n) if ref.span[i]]
    source = list(range(n - 1)) + copies
    copy = [False] * (n - 1) + [True] * len(copies)
    mask = torch.zeros(len(source), len(source), dtype=torch.bool)
    for a, (q, cq) in enumerate(zip(source, copy)):
        for b, (k, ck) in enumerate(zip(source, copy)):
            if cq and ck:
                mask[a, b] = ref.span[q] == ref.span[k]
            elif cq:  # a copy sees what its span sees, except the clean span it copies
                mask[a, b] = ref.visible(q, k) and ref.span[k] != ref.span[q]
            elif not ck:
                mask[a, b] = ref.visible(q, k)
    return source, mask


# catches: a span seeing another span, a span attending causally only, plan tokens seeing a span before its
# sync, a noised copy seen by (or seeing) the clean response (the planted bugs in the module docstring).
def test_training_mask_equals_the_reference(setup):
    path, tok, prompt, ref = setup
    layout = PDLayout.parse(len(prompt), ref.ids, PDTokenIds.from_tokenizer(tok), tok.decode)
    assert len(layout.rounds) == 3 and layout.malformed.unsynced_rounds == 1
    assert torch.equal(layout.dense_mask(), ref.mask())
    q = torch.arange(len(layout))
    assert torch.equal(layout.mask_mod()(0, 0, q[:, None], q[None, :]), ref.mask())
    noised = NoisedLayout(layout, noise_of(ref, layout), PDTokenIds.from_tokenizer(tok).mask)
    item = window_input(prompt, ref.ids, bind_policy_vocab("planned_diffusion", tok), 1.0, layout=noised)
    _, expected = stream_reference(ref)
    assert torch.equal(pack_windows([item]).visibility.dense_mask(), expected)


# catches: the same bugs in what the model computes (the mask reaching the forward), the noised copies' inputs
# or positions wrong, a diffusion target scored at the wrong position or a <sync/> not predicted by its plan's
# last />.
def test_learner_logprobs_match_a_float64_dense_forward(setup):
    path, tok, prompt, ref = setup
    tags = PDTokenIds.from_tokenizer(tok)
    layout = PDLayout.parse(len(prompt), ref.ids, tags, tok.decode)
    noise = noise_of(ref, layout)
    source, mask = stream_reference(ref)
    all_ids = torch.tensor(prompt + ref.ids)
    n = len(ref.span)
    inputs = all_ids[source].clone()
    for a in range(n - 1, len(source)):
        if noise.masked[source[a]]:
            inputs[a] = tags.mask
    model = load_model(path).double()
    with torch.no_grad():
        logp = model.compute_logits(model(inputs, torch.tensor(source), DenseAttention(mask))).double().log_softmax(-1)
    expected = []
    last = len(prompt) - 1
    for i in range(len(prompt), n):  # autoregressive targets: the previous autoregressive token predicts
        expected.append(float(logp[last, all_ids[i]]) if ref.span[i] == 0 else None)
        last = i if ref.span[i] == 0 else last
    for a in range(n - 1, len(source)):  # diffusion targets: each copied body token at its own position
        if source[a] in ref.body:
            expected.append(float(logp[a, all_ids[source[a]]]))
    model = load_model(path)
    policy = bind_policy_vocab("planned_diffusion", tok, model)
    with torch.no_grad():
        got = recompute_logprobs(model, prompt, ref.ids, policy, layout=NoisedLayout(layout, noise, tags.mask),
                                 backend="sdpa")
    assert got.shape == (len(expected),)
    scored = [i for i, e in enumerate(expected) if e is not None]
    assert max(abs(float(got[i]) - expected[i]) for i in scored) < 1e-4


# ---- the runtime ------------------------------------------------------------------------------------


def engine_run(path, prompt: list[int], script: list[int], device: str = "cpu", **knobs):
    """A forced autoregressive script under kv=planned_diffusion, greedy; every denoising forward's (token ids,
    positions, logits) recorded."""
    from sliderl.rollout import LLM, SamplingParams

    llm = LLM(str(path), kv="planned_diffusion", num_blocks=64, device=device, **knobs)
    calls, forward = [], llm.mode._forward

    def recording(ids, pos, prefixes, span_ids, views, rows, writes=None):
        logits = forward(ids, pos, prefixes, span_ids, views, rows, writes)
        if rows is not None:
            calls.append((list(ids), list(pos), list(rows), logits.cpu().clone()))  # _draw bans tags in place
        return logits

    llm.mode._forward = recording
    seq = llm.add_request(prompt, SamplingParams(max_tokens=200, temperature=0.0))
    llm.force(seq, script)
    while llm.has_unfinished():
        llm.step()
    return llm.output(seq), calls


def round_mask(keys: list[int], span_of: dict[int, int], view: dict[int, int]) -> torch.Tensor:
    """The rule over positions ``keys`` (increasing) of a response with one round: before it causal; a span
    token sees everything up to its promise's /> (``view`` by span) and its own span (``span_of``); after the
    spans (the <sync/> on) causal over everything."""
    mask = torch.zeros(len(keys), len(keys), dtype=torch.bool)
    for a, q in enumerate(keys):
        for b, k in enumerate(keys):
            s = span_of.get(q)
            mask[a, b] = (k <= view[s] or s == span_of.get(k)) if s else k <= q
    return mask


# catches: in a denoising forward, a span seeing another span (planted: SpanBatch.mask ignoring span ids) or only
# its earlier tokens (planted: the own-span mask lower-triangular); after the commit, the spans' KV written wrong
# or the <sync/> not seeing them (the logprob of the token after the <sync/> then differs). On CUDA the same with
# the engine's kernels and CUDA graphs for the autoregressive steps.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_runtime_denoising_and_sync_match_a_float64_dense_forward(setup, device):
    path, tok, prompt, _ = setup
    script = tok('ab<promise topic="A" tokens="1"/><promise topic="B" tokens="2"/><sync/>cd',
                 add_special_tokens=False).input_ids + [tok.eos_token_id]
    out, calls = engine_run(path, prompt, script, device, pd_steps_ratio=0.5)
    assert len(calls) == 10  # span B: 20 body tokens at 0.5 steps a token (span A's 10 take 5)
    full = prompt + out.token_ids
    first = calls[0][1][0]  # the first <async>: everything before it is the cached context and plan
    sync = len(prompt) + out.planned_diffusion.rounds[0].sync
    span_of = {p: 1 if p < first + 12 else 2 for p in range(first, sync)}  # A: <async>, 10 body, </async>
    closes = [i for i, t in enumerate(full[:first]) if t == tok.convert_tokens_to_ids("/>")]
    view = {1: closes[-2], 2: closes[-1]}  # each span's promise's />
    tol = 1e-4 if device == "cpu" else 1e-2  # CUDA: the kernels' float32 matmuls may run in TF32
    model = load_model(path).double()
    for step, (ids, pos, rows, logits) in enumerate(calls):
        keys = list(range(first)) + pos
        with torch.no_grad():
            hidden = model(torch.tensor(full[:first] + ids), torch.tensor(keys),
                           DenseAttention(round_mask(keys, span_of, view)))
            want = model.compute_logits(hidden[[first + r for r in rows]]).double()
        assert (logits.double() - want).abs().max() < tol, f"denoising step {step}"
    keys = list(range(sync + 1))
    with torch.no_grad():
        hidden = model(torch.tensor(full[:sync + 1]), torch.tensor(keys),
                       DenseAttention(round_mask(keys, span_of, view)))
        want = model.compute_logits(hidden[sync:]).double().log_softmax(-1)[0, full[sync + 1]]
    assert abs(out.logprobs[sync + 1 - len(prompt)] - float(want)) < tol


# catches: requests denoised together reading each other's context or spans (a padded batch row taking another
# request's prefix or span ids), a request's draws depending on its batch, a round started while another
# request decodes autoregressively left waiting or run twice.
def test_requests_denoised_together_write_what_they_write_alone(setup):
    from sliderl.rollout import LLM, SamplingParams

    path, tok, _, _ = setup
    jobs = [(tok("Q: one\n").input_ids, 'ab<promise topic="A" tokens="1"/><promise topic="B" tokens="2"/><sync/>c'),
            (tok("Q: a longer prompt\n").input_ids, 'x<promise topic="C" tokens="5"/><sync/>yz<promise topic="D" '
                                                   'tokens="1"/><sync/>w')]
    scripts = [tok(s, add_special_tokens=False).input_ids + [tok.eos_token_id] for _, s in jobs]

    def run(which: list[int]):
        llm = LLM(str(path), kv="planned_diffusion", num_blocks=128, pd_steps_ratio=0.5)
        seqs = []
        for i in which:
            seqs.append(llm.add_request(jobs[i][0], SamplingParams(max_tokens=200, temperature=0.7, seed=i)))
            llm.force(seqs[-1], scripts[i])
        while llm.has_unfinished():
            llm.step()
        return [llm.output(s) for s in seqs], llm.mode.stats

    together, stats = run([0, 1])
    alone = [run([0])[0][0], run([1])[0][0]]
    assert stats.denoising_forwards < sum(o.planned_diffusion.denoising_forwards for o in together)  # shared forwards
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids and len(a.planned_diffusion.rounds) == len(b.planned_diffusion.rounds)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


# ---- denoising forwards padded to buckets (rollout.planned_diffusion.span_graphs) ----------------------


def span_runner(path, device: str):
    """A float32 ``ModelRunner`` (no decode graphs) whose pool holds random K/V (seeded)."""
    runner = ModelRunner(load_model(path, device=device), 64, 16, torch.device(device), torch.float32, 4, 1024,
                         cuda_graphs=False)
    fill_pool(runner)
    return runner


def fill_pool(runner, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for pool in runner.cache.k + runner.cache.v:
        pool.copy_(torch.randn(pool.shape, generator=gen))


def span_inputs(requests: list[tuple[int, list[int]]], seed: int) -> tuple[list, ...]:
    """A denoising forward's inputs, random but valid: per request (its prefix length, its spans' lengths), the
    prefix in distinct pool slots of a 64 x 16 pool, each span's view a position inside the prefix, token ids
    below the tiny vocabulary, positions after the prefix, and every other token a wanted row."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(64 * 16, generator=gen).tolist()
    ids, pos, prefixes, span_ids, views = [], [], [], [], []
    for length, spans in requests:
        prefixes.append(slots[:length])
        slots = slots[length:]
        span_ids.append([k for k, n in enumerate(spans) for _ in range(n)])
        seen = torch.randint(0, length, (len(spans),), generator=gen).tolist()
        views.append([seen[k] for k in span_ids[-1]])
        ids += torch.randint(0, 200, (len(span_ids[-1]),), generator=gen).tolist()
        pos += range(length, length + len(span_ids[-1]))
    return ids, pos, prefixes, span_ids, views, list(range(0, len(ids), 2))


def exact_logits(runner, ids, pos, prefixes, span_ids, views, rows) -> torch.Tensor:
    """The denoising forward at its exact shape, eagerly (``PDRuntime._forward`` with ``cuda_graphs=False``, which
    the float64 dense tests above check)."""
    dev, model = runner.device, runner.model
    batch = SpanBatch.build(prefixes, span_ids, views, dev)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                       SpanAttention(runner.cache, batch, runner.scale))
        return model.compute_logits(hidden[rows])


# Three requests of different prefix lengths (5, 37, 300) and span counts (1, 2, 3): exact shape R=3, S=12+24=36,
# L=300, N=3+36+28=67; bucket R'=4 (a pad request), S'=64, L'=512, so every request has pad prefix columns (the
# longest 212, read from pool slot 0, which holds random K/V) and pad key slots, and 4 x 64 - 67 = 189 pad tokens
# follow the span tokens.
BUCKET_REQUESTS = [(5, [3]), (37, [12, 24]), (300, [7, 1, 20])]


# catches: a pad prefix column visible to a real query (planted: SpanBatch.mask's prefix term true for every
# column: logits off by up to 7.8), a pad key slot visible to a real query (planted: pad span ids 0 instead of -1
# and the own-span term without query_valid: off by up to 6.9), the flat stream's span tokens not first (planted:
# the pad tokens in front of them: every logit off, by up to 9.2), a wrong bucket (hand-computed here).
def test_padded_bucket_forward_equals_the_exact_forward(setup):
    path = setup[0]
    runner = span_runner(path, "cpu")
    inputs = span_inputs(BUCKET_REQUESTS, seed=1)
    assert bucket_of(3, 36, 300) == (4, 64, 512)  # 3 -> 4, ceil(36 / 32) x 32, ceil(300 / 256) x 256
    assert bucket_of(1, 1, 1) == (1, 32, 256) and bucket_of(5, 64, 256) == (8, 64, 256)
    graphs = SpanGraphs(runner)
    assert not graphs.capture  # CPU: the padded forward runs eagerly
    with torch.inference_mode():
        padded = graphs.logits(*inputs)
    assert padded.shape == (34, runner.model.config.vocab_size)
    torch.testing.assert_close(padded, exact_logits(runner, *inputs), rtol=1e-5, atol=1e-5)


# catches: a graph's static inputs filled wrong, checked on the CPU without a graph: the all-pad buffers
# SpanGraphs._capture builds, then this step's layout copied into them with SpanBatch.copy_ (what a replay reads),
# must give the exact forward's logits. Planted: copy_ skipping span_ids (the static batch keeps the all-pad -1
# ids, so every query sees only its request's first key) fails this; so would a static batch of another shape.
def test_static_buffers_filled_by_copy_give_the_exact_forward(setup):
    path = setup[0]
    runner = span_runner(path, "cpu")
    ids, pos, prefixes, span_ids, views, rows = inputs = span_inputs(BUCKET_REQUESTS, seed=6)
    bucket = bucket_of(len(span_ids), max(map(len, span_ids)), max(map(len, prefixes)))
    n = bucket[0] * bucket[1]
    static = SpanBatch.build([[]], [[]], [[]], runner.device, bucket=bucket)  # as at capture: every slot a pad
    static_ids, static_pos = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    static.copy_(SpanBatch.build(prefixes, span_ids, views, torch.device("cpu"), bucket=bucket))
    static_ids.copy_(torch.tensor(ids + [0] * (n - len(ids))))
    static_pos.copy_(torch.tensor(pos + [0] * (n - len(pos))))
    with torch.inference_mode():
        hidden = runner.model(static_ids, static_pos, SpanAttention(runner.cache, static, runner.scale))
        logits = runner.model.compute_logits(hidden[rows])
    torch.testing.assert_close(logits, exact_logits(runner, *inputs), rtol=1e-5, atol=1e-5)


# catches: a generation that changes when its denoising forwards are padded to buckets (with cuda_graphs on, CPU
# pads them too): each of the three bugs planted for the test above changed the span tokens drawn here; a pad
# request (three rounds denoise together: bucket R' = 4) disturbing the real rows' draws.
def test_generation_with_buckets_equals_generation_at_exact_shapes(setup):
    from sliderl.rollout import LLM, SamplingParams

    path, tok, _, _ = setup
    jobs = [("Q: one\n", ('a<promise topic="A" tokens="2"/><sync/>b<promise topic="B" tokens="1"/><promise topic="F" '
                          'tokens="1"/><sync/>c')),
            ("Q: a longer prompt\n", 'x<promise topic="C" tokens="1"/><sync/>yz<promise topic="D" tokens="1"/><sync/>w'),
            ("Q: three\n", 'q<promise topic="E" tokens="1"/><sync/>r')]
    scripts = [tok(s, add_special_tokens=False).input_ids + [tok.eos_token_id] for _, s in jobs]

    def run(cuda_graphs: bool):
        llm = LLM(str(path), kv="planned_diffusion", num_blocks=128, pd_steps_ratio=0.5, cuda_graphs=cuda_graphs)
        assert (llm.mode.graphs is not None) == cuda_graphs
        seqs = []
        for i, (prompt, _) in enumerate(jobs):
            seqs.append(llm.add_request(tok(prompt).input_ids, SamplingParams(max_tokens=200, temperature=0.0, seed=i)))
            llm.force(seqs[-1], scripts[i])
        while llm.has_unfinished():
            llm.step()
        return [llm.output(s) for s in seqs], llm.mode.stats

    padded, stats = run(True)
    exact, _ = run(False)
    # ratio 0.5: 5 forwards of the three first rounds together (spans of 20, 10 and 10 body tokens), 5 more of the
    # first request's 20-token span alone, then its second round (5) and the second request's (5): 30 in 20
    assert [o.planned_diffusion.denoising_forwards for o in padded] == [15, 10, 5] and stats.denoising_forwards == 20
    for a, b in zip(padded, exact):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


# catches: a replayed graph that is not the eager forward: a static input not copied in before the replay (the
# reused bucket's second content differs from its first in every field), the mask computed once at capture
# instead of at each replay (SpanAttention made outside the graph), a bucket captured again on its second use,
# the least recently used bucket not the one dropped past MAX_GRAPHS, a graph still reading a released pool.
@pytest.mark.gpu
def test_span_graphs_replay_equals_the_eager_forward(setup, monkeypatch):
    path = setup[0]
    runner = span_runner(path, "cuda")
    graphs, eager = SpanGraphs(runner), SpanGraphs(runner, capture=False)
    assert graphs.capture and not eager.capture
    small = [span_inputs([(40, [10])], seed=2), span_inputs([(100, [4, 16])], seed=3)]  # both (1, 32, 256)
    large = span_inputs(BUCKET_REQUESTS, seed=4)  # (4, 64, 512)
    third = span_inputs([(20, [40]), (9, [2])], seed=5)  # (2, 64, 256)

    def check(inputs, captures: int) -> None:
        with torch.inference_mode():
            got = graphs.logits(*inputs)
            same_shape = eager.logits(*inputs)
        assert graphs.captures == captures
        torch.testing.assert_close(got, same_shape, rtol=1e-4, atol=1e-4)  # the same kernels, replayed
        exact = exact_logits(runner, *inputs)
        assert (got - exact).abs().max() < 1e-2  # other shapes: the float32 matmuls may run in TF32

    check(small[0], 1)
    check(large, 2)
    check(small[1], 2)  # the first bucket replays, not captured again
    assert list(graphs.graphs) == [(4, 64, 512), (1, 32, 256)]  # least recently used first
    monkeypatch.setattr(span_graphs, "MAX_GRAPHS", 2)
    check(third, 3)
    assert list(graphs.graphs) == [(1, 32, 256), (2, 64, 256)]  # (4, 64, 512) dropped
    runner.release()  # the pool goes (sleep); its graphs with it
    assert not graphs.graphs
    runner.allocate()
    fill_pool(runner, seed=6)
    check(small[0], 4)
