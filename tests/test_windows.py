"""Training windows (truncated, chunked, full) and the training attention built from a KV policy.

Window expectations are worked out by hand from DESIGN.md's "Truncated window": a trace of P
prompt and T generated tokens; generated token j sits at position P + j; the model is fed the
prompt and the token before every target. Attention backends are checked against a float64 dense
reference whose mask is written out here from DESIGN.md's table, not taken from core.kv_policy.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from sliderl.core.kv_policy import NEVER, KVPolicy
from sliderl.trainer.attention import (
    SHORT_DOCUMENT,
    FlexPolicyAttention,
    MaskedSDPA,
    PackedVisibility,
    auto_backend,
    flex_bucket,
    training_attention,
)
from sliderl.trainer.windows import chunked_windows, full_window, training_windows, truncated_window

P, T, W = 5, 100, 8  # prompt tokens, generated tokens, window: T is much longer than k·W for k = 1, 2, 4


def r(a, b):
    return list(range(a, b))


# ---- truncated: prompt + last min(T, k·W) generated tokens, loss on the last W ---------------------
@pytest.mark.parametrize("k, inputs, targets, mask", [
    # k=1: keep 8 targets j = 92..99 (positions 97..104); their predecessors are positions 96..103.
    (1, r(0, 5) + r(96, 104), r(97, 105), [True] * 8),
    # k=2: keep 16 targets j = 84..99 (positions 89..104), inputs 88..103; loss on the last 8.
    (2, r(0, 5) + r(88, 104), r(89, 105), [False] * 8 + [True] * 8),
    # k=4: keep 32 targets j = 68..99 (positions 73..104), inputs 72..103; loss on the last 8.
    (4, r(0, 5) + r(72, 104), r(73, 105), [False] * 24 + [True] * 8),
])
def test_truncated_window_selects_hand_worked_tokens(k, inputs, targets, mask):
    w = truncated_window(P, T, W, multiplier=k)
    assert w.input_positions().tolist() == inputs
    assert w.target_positions().tolist() == targets
    assert w.loss_mask().tolist() == mask
    assert w.num_inputs == len(inputs) and w.truncated
    # every target's predictor is the input one position before it
    assert w.input_positions()[w.predictor_index()].tolist() == [t - 1 for t in targets]
    # tokens: with trace ids = 1000 + position, the fed ids are the selected positions' ids
    ids = torch.arange(P + T) + 1000
    assert ids[w.input_positions()].tolist() == [1000 + p for p in inputs]


def test_truncated_window_keeps_everything_when_nothing_is_cut():
    # T = 20 <= k·W = 32: all 20 generated tokens are targets and all carry a loss;
    # inputs are positions 0..23 (the prompt, then generated 0..18 as predecessors of 1..19).
    w = truncated_window(P, 20, W, multiplier=4)
    assert w.input_positions().tolist() == r(0, 24)
    assert w.target_positions().tolist() == r(5, 25)
    assert w.loss_mask().tolist() == [True] * 20 and not w.truncated
    # exactly k·W generated tokens is not a cut either
    assert truncated_window(P, 32, W, 4).loss_mask().all()


def test_forced_tokens_are_excluded_from_the_loss():
    forced = [False] * T
    forced[95] = forced[80] = True  # 95 is a loss token of the k=2 window, 80 is not even a target
    w = truncated_window(P, T, W, multiplier=2)
    expected = [False] * 8 + [True] * 8
    expected[95 - 84] = False  # j = 95 is the 12th target (index 11)
    assert w.loss_mask(forced).tolist() == expected
    with pytest.raises(ValueError, match="one flag per generated token"):
        w.loss_mask([False] * 3)


def test_chunked_windows_give_every_generated_token_a_loss_exactly_once():
    for k in (1, 2, 4):
        windows = chunked_windows(P, T, W, multiplier=k)
        counts = torch.zeros(T, dtype=torch.int64)
        for w in windows:
            loss_j = w.target_positions()[w.loss_mask()] - P
            counts[loss_j] += 1
            assert w.loss_start - w.target_start <= (k - 1) * W  # at most (k-1)·W context targets
            assert w.target_end - w.loss_start <= W
        assert counts.tolist() == [1] * T
        assert windows[-1] == truncated_window(P, T, W, k)  # the last chunk is the truncated window
    # k=2, T=100, W=8: 100 = 12·8 + 4 -> 13 chunks; the first has loss on j = 0..3 (targets 0..3),
    # the second loss 4..11 with targets from max(0, 4 - 8) = 0, the third loss 12..19 targets 4..19.
    windows = chunked_windows(P, T, W, multiplier=2)
    assert len(windows) == 13
    spans = [(w.target_start, w.loss_start, w.target_end) for w in windows[:3]]
    assert spans == [(0, 0, 4), (0, 4, 12), (4, 12, 20)]


def test_full_window_and_mode_dispatch():
    w = full_window(P, 7)
    assert w.input_positions().tolist() == r(0, 11) and w.target_positions().tolist() == r(5, 12)
    assert training_windows("truncated", P, T, None) == [full_window(P, T)]  # a policy without a window
    assert training_windows("full", P, T, W) == [full_window(P, T)]
    with pytest.raises(ValueError, match="unknown window mode 'sliding'"):
        training_windows("sliding", P, T, W)
    with pytest.raises(ValueError, match="nothing to train on"):
        truncated_window(P, 0, W)
    with pytest.raises(ValueError, match="window W must be >= 1"):
        truncated_window(P, T, 0)


# ---- training attention --------------------------------------------------------------------------
def rule_mask(spec: str, positions: list[int], prompt_len: int) -> torch.Tensor:
    """[N, N] bool straight from DESIGN.md's table, for windowed policies and full."""
    q = torch.tensor(positions)[:, None]
    k = torch.tensor(positions)[None, :]
    kind, *args = spec.split(":")
    keep = {"full": lambda: torch.ones_like(q - k, dtype=torch.bool),
            "prefix_sliding": lambda: (k < prompt_len) | (q - k < int(args[0])),
            "sliding_window": lambda: q - k < int(args[0]),
            "streaming": lambda: (k < int(args[0])) | (q - k < int(args[1]))}[kind]()
    return (k <= q) & keep


def reference_attention(q, k, v, mask):
    """float64 softmax attention with GQA by repeat: q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, -math.inf).softmax(-1), v)


def packed_case():
    """Two truncated windows of two traces under different policies, packed into one stream."""
    a = truncated_window(6, 90, 8, 2)  # prefix_sliding:8
    b = truncated_window(3, 40, 5, 4)  # streaming:2:5
    parts, masks = [], []
    for w, spec in ((a, "prefix_sliding:8"), (b, "streaming:2:5")):
        pos = w.input_positions()
        death = KVPolicy.parse(spec).death_positions(w.prompt_len, torch.zeros(w.prompt_len + w.num_generated))
        parts.append((pos, death[pos]))
        masks.append(rule_mask(spec, pos.tolist(), w.prompt_len))
    return PackedVisibility.pack(parts), torch.block_diag(*masks).bool()


def test_packed_visibility_is_the_rule_per_window():
    vis, expected = packed_case()
    assert torch.equal(vis.dense_mask(), expected)
    assert vis.num_docs == 2 and not vis.causal_only


@pytest.mark.parametrize("backend", ["sdpa", "dense", "flex-eager"])
def test_backends_match_float64_reference(backend):
    vis, mask = packed_case()
    n = len(vis)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 16, generator=gen) for h in (4, 2, 2))  # GQA: 4 query heads, 2 KV heads
    if backend == "flex-eager":  # FlexAttention's own reference path; the compiled kernel runs on CUDA
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = FlexPolicyAttention(vis, compiled=False)(0, q, k, v)
    else:
        out = training_attention(vis, "cpu", backend)(0, q, k, v)
    assert out.shape == (n, 4, 16)
    assert (out.double() - reference_attention(q, k, v, mask)).abs().max() < 1e-5


def test_full_single_document_uses_causal_attention():
    w = truncated_window(4, 50, 8, 2)
    pos = w.input_positions()
    vis = PackedVisibility.pack([(pos, torch.full_like(pos, NEVER))])
    attn = training_attention(vis, "cpu")
    assert isinstance(attn, MaskedSDPA) and attn.mask is None
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(len(pos), h, 8, generator=gen) for h in (2, 1, 1))
    ref = reference_attention(q, k, v, rule_mask("full", pos.tolist(), 4))
    assert (attn(0, q, k, v).double() - ref).abs().max() < 1e-5


# Catches: pad tokens that see each other (one shared document at one position), which makes the block
# mask hold the whole pad x pad square, so FlexAttention computes it densely — 3x the real attention of
# a 32K whole trace padded to 64K (measured on the H200: 34.7 s vs transformers' 17.5 s per step).
# A stream of 130 real tokens padded to 1024: 8 blocks of 128 per side; the real tokens occupy block
# row/column 0-1, so with pads seeing only themselves the pad rows 2..7 each hold only their diagonal
# block (and pad slots 130..255 of block 1 see themselves inside block 1's diagonal): 6 pad blocks.
def test_pad_tokens_see_only_themselves_so_flex_skips_their_square():
    from torch.nn.attention.flex_attention import create_block_mask

    pos = torch.arange(130)
    vis = PackedVisibility.pack([(pos, torch.full_like(pos, NEVER))]).padded(1024)
    dense = vis.dense_mask()
    assert torch.equal(dense[130:, 130:], torch.eye(1024 - 130, dtype=torch.bool))  # each pad: itself only
    assert not dense[130:, :130].any() and not dense[:130, 130:].any()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        blocks = create_block_mask(vis.mask_mod(), None, None, 1024, 1024, device="cpu", _compile=False)
    per_row = blocks.kv_num_blocks[0, 0] + (blocks.full_kv_num_blocks[0, 0] if blocks.full_kv_num_blocks is not None else 0)
    assert per_row.tolist() == [1, 2, 1, 1, 1, 1, 1, 1], per_row.tolist()


# Catches: CUDA's auto backend building FlexAttention's block mask over a stream of many short
# documents — create_block_mask evaluates the rule at all N² pairs of the padded stream: 64 register
# traces of ~620 tokens in one 64K stream cost ~0.9 s per SFT step on the H200, while per document
# they hold 64·620² ≈ 25M pairs. A long document (over SHORT_DOCUMENT) keeps flex and its block sparsity
# (the learner benchmark's 32K windows), and CPU keeps its own rule (dense mask unless batching is cheaper).
def test_auto_backend_batches_short_documents_per_document_on_cuda_too():
    def stream(lengths):
        return PackedVisibility.pack([(torch.arange(n), torch.full((n,), NEVER)) for n in lengths])

    short = stream([620] * 64)
    assert auto_backend(short, "cuda") == "documents" and auto_backend(short, "cpu") == "documents"
    long_windows = stream([SHORT_DOCUMENT + 1] * 8)  # 2·8·2049² < (8·2049)²: cheaper per document, but long
    assert auto_backend(long_windows, "cuda") == "flex" and auto_backend(long_windows, "cpu") == "documents"
    assert auto_backend(stream([4096]), "cuda") == auto_backend(stream([4096]), "cpu") == "causal"  # one full doc
    two = stream([100, 100])  # 2·D·T² = 2·2·100² = 40000 is not under N² = 200² = 40000: flex / the dense mask
    assert auto_backend(two, "cuda") == "flex" and auto_backend(two, "cpu") == "sdpa"


def test_flex_buckets_and_bad_backend():
    assert [flex_bucket(n) for n in (1, 128, 129, 1000, 1024, 1025)] == [128, 128, 256, 1024, 1024, 2048]
    vis, _ = packed_case()
    with pytest.raises(ValueError, match="unknown attention backend 'triton'"):
        training_attention(vis, "cpu", "triton")


@pytest.mark.gpu
def test_compiled_flex_forward_and_backward_match_sdpa_on_cuda():
    vis, mask = packed_case()
    n = len(vis)
    gen = torch.Generator().manual_seed(2)
    tensors = [torch.randn(n, h, 64, generator=gen).cuda().requires_grad_() for h in (8, 2, 2)]
    flex = training_attention(vis, "cuda", "flex")
    out = flex(0, *tensors)
    grads = torch.autograd.grad(out.square().sum(), tensors)
    ref = MaskedSDPA(mask.cuda())(0, *tensors)
    ref_grads = torch.autograd.grad(ref.square().sum(), tensors)
    assert (out - ref).abs().max() < 1e-4
    for g, rg in zip(grads, ref_grads):
        assert (g - rg).abs().max() < 1e-3


# Catches: the per-document SDPA that CUDA's auto backend now takes for short documents failing or
# diverging on CUDA (GQA with a boolean mask per document, forward and backward) — checked against the
# same packed stream's dense mask on the CPU in float64.
@pytest.mark.gpu
def test_auto_backend_per_document_on_cuda_matches_the_dense_reference():
    vis = PackedVisibility.pack([(torch.arange(n), torch.full((n,), NEVER)) for n in (30, 40, 20, 35, 25, 30)])
    mask = vis.dense_mask()
    assert auto_backend(vis, "cuda") == "documents"
    gen = torch.Generator().manual_seed(3)
    cpu = [torch.randn(len(vis), h, 64, generator=gen, dtype=torch.float64, requires_grad=True) for h in (8, 2, 2)]
    cuda = [x.detach().float().cuda().requires_grad_() for x in cpu]
    out = training_attention(vis, "cuda")(0, *cuda)
    grads = torch.autograd.grad(out.square().sum(), cuda)
    ref = reference_attention(*cpu, mask)
    ref_grads = torch.autograd.grad(ref.square().sum(), cpu)
    assert (out.double().cpu() - ref).abs().max() < 1e-4
    for g, rg in zip(grads, ref_grads):
        assert (g.double().cpu() - rg).abs().max() < 1e-3


def test_many_short_documents_batch_per_document_and_match_the_reference_with_gradients():
    # catches: a wrong slot/gather map or a mask leaking across documents in the per-document SDPA
    # (six windows of 7..20 tokens: 6·20² = 2400 mask entries < 73²/2, so sdpa batches by document)
    specs = ["prefix_sliding:4", "full", "streaming:1:3", "sliding_window:5", "full", "prefix_sliding:2"]
    parts, masks = [], []
    for i, spec in enumerate(specs):
        w = truncated_window(3, 4 + 3 * i, 100, 1)  # whole trace: 3 + 4 + 3i - 1 inputs
        pos = w.input_positions()
        death = KVPolicy.parse(spec).death_positions(w.prompt_len, torch.zeros(w.prompt_len + w.num_generated))
        parts.append((pos, death[pos]))
        masks.append(rule_mask(spec, pos.tolist(), w.prompt_len))
    vis, mask = PackedVisibility.pack(parts), torch.block_diag(*masks).bool()
    attn = training_attention(vis, "cpu", "sdpa")
    assert isinstance(attn, MaskedSDPA) and attn.documents is not None
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(len(vis), h, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    weights = torch.randn(len(vis), 4, 8, generator=gen, dtype=torch.float64)
    (attn(0, q, k, v) * weights).sum().backward()
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    out = reference_attention(q, k, v, mask)
    (out * weights).sum().backward()
    torch.testing.assert_close(attn(0, q, k, v), out)
    for g, x in zip(got, (q, k, v)):
        torch.testing.assert_close(g, x.grad)


# Catches: the vectorised deaths of the non-register policies (KVPolicy.death_positions, which no longer
# walks a DeathTracker token by token: ~1.4 s per learner step of 32 traces of 8K tokens) departing from the
# engine's own incremental rule — compared with a DeathTracker walk (what the engine follows while decoding)
# for every windowed and unbounded policy, prompts shorter and longer than the window, and a hand case:
# prefix_sliding:3 with a 2-token prompt keeps 0-1 forever and kills position p at p + 3.
@pytest.mark.parametrize("spec", ["full", "prefix_sliding:3", "sliding_window:4", "streaming:2:3", "h2o:256"])
@pytest.mark.parametrize("prompt_len", [0, 2, 9])
def test_death_positions_equal_the_engines_token_by_token_deaths(spec, prompt_len):
    policy = KVPolicy.parse(spec)
    ids = list(range(100, 117))
    tracker = policy.tracker(prompt_len)
    for pos, tok in enumerate(ids):
        tracker.append(pos, tok)
    assert policy.death_positions(prompt_len, ids).tolist() == tracker.death
    if spec == "prefix_sliding:3" and prompt_len == 2:
        assert policy.death_positions(prompt_len, ids[:6]).tolist() == [NEVER, NEVER, 5, 6, 7, 8]
