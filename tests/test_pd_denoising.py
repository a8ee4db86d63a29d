"""Planned Diffusion's denoising loop (rollout.planned_diffusion) with a scripted model: which positions each step
reveals under the entropy order, the confidence threshold and the steps-per-token ratio.

The scripted model ignores attention: the logits at position p put ``SHARPNESS[p]`` on one token and 0 on every
other, so p's predicted entropy falls, and its confidence rises, with its sharpness. The expectations follow
from the knobs' definitions (rollout.planned_diffusion.unmasking), worked out by hand below.
"""

from __future__ import annotations

import torch

from sliderl.core.kv_policy import KVPolicy
from sliderl.core.planned_diffusion import PD_TOKENS, PDTokenIds
from sliderl.core.tiny import build_tokenizer
from sliderl.kernels.metadata import PagedKVCache
from sliderl.rollout.block_manager import BlockManager
from sliderl.rollout.engine_args import EngineArgs
from sliderl.rollout.mode import EngineContext
from sliderl.rollout.planned_diffusion.runtime import PDRuntime
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.scheduler import Scheduler

TOKEN = ord("z")  # what every position predicts


class ScriptedModel:
    """Hidden state = the position; logits put ``sharpness[position]`` on TOKEN."""

    def __init__(self, sharpness: dict[int, float], vocab: int):
        self.sharpness, self.vocab = sharpness, vocab

    def __call__(self, ids, positions, attn):
        return positions.double()[:, None]

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], self.vocab)
        logits[:, TOKEN] = torch.tensor([self.sharpness.get(int(p), 0.0) for p in hidden[:, 0]])
        return logits


class ScriptedRunner:
    device = torch.device("cpu")
    scale = 1.0

    def __init__(self, model):
        self.model = model
        self.cache = PagedKVCache.allocate(1, 32, 16, 1, 2, torch.float32, "cpu")
        self.mode_graphs = []

    @staticmethod
    def host_tensor(values, dtype=None):
        return torch.tensor(values, dtype=dtype)


def runtime_with(units: list[int], sharpness: dict[int, float], **knobs) -> tuple[PDRuntime, object]:
    """A runtime over the scripted model, and a request whose plan (one promise of N units per ``units``) has just
    executed: its round is scaffolded, nothing revealed yet."""
    tok = build_tokenizer(PD_TOKENS)
    scheduler = Scheduler(BlockManager(32), 4, 1024, 4096, admit_by_bound=True, watermark_blocks=0)
    context = EngineContext(scheduler, KVPolicy.parse("planned_diffusion"), tok, frozenset({tok.eos_token_id}), 16,
                            4096, 1024, ScriptedRunner(ScriptedModel(sharpness, len(tok))))
    runtime = PDRuntime(context, EngineArgs(kv="planned_diffusion", **knobs))
    seq = runtime.new_request(0, tok("Q").input_ids, SamplingParams(max_tokens=400, temperature=0.0), 0, 0.0)
    tags = PDTokenIds.from_tokenizer(tok)
    for token in tok("ab", add_special_tokens=False).input_ids:
        seq.append_token(token, 0.0, False)
    for n in units:
        for token in tok(f'<promise tokens="{n}"/>', add_special_tokens=False).input_ids:
            seq.append_token(token, 0.0, False)
            seq.read_token()
    seq.append_token(tags.sync, 0.0, False)
    assert seq.read_token()  # the <sync/> right after the plan executes it
    scheduler.allocate(seq, len(seq.token_ids) - 1)
    seq.num_computed = len(seq.token_ids) - 1
    seq.start_round(runtime.knobs)
    runtime.diffusing.append(seq)
    return runtime, seq


def reveal_steps(runtime, seq) -> list[set[int]]:
    """The body positions (offsets from each span's first body token, as (span, offset)) each step reveals."""
    spans, mask = seq.round.spans, seq.tags.mask
    starts = [s.body_start for s in spans]
    seen, steps = set(), []
    while runtime.diffusing:
        runtime.denoise_step()
        now = {(k, p - a) for k, a in enumerate(starts) for p in range(a, a + spans[k].length)
               if seq.token_ids[p] != mask}
        steps.append(now - seen)
        seen = now
    return steps


def body_sharpness(seq_start: int, values: list[float]) -> dict[int, float]:
    return {seq_start + i: v for i, v in enumerate(values)}


def first_body(units: list[int]) -> int:
    """The token index of the round's first body position."""
    runtime, seq = runtime_with(units, {})
    return seq.round.spans[0].body_start


# catches: the order reversed (highest entropy first: planted, sort key -priority), ties broken by anything but
# position, the positions not revealed one a step at ratio 1.
def test_entropy_order_reveals_positions_lowest_entropy_first():
    start = first_body([1])
    values = [2.0, 9.0, 1.0, 7.0, 4.0, 9.0, 0.5, 3.0, 8.0, 6.0]  # sharper = lower entropy
    runtime, seq = runtime_with([1], body_sharpness(start, values), pd_steps_ratio=1.0)
    steps = reveal_steps(runtime, seq)
    # one position a step, sharpest first; 1 and 5 tie at 9.0: the earlier position first
    assert [sorted(o for _, o in s) for s in steps] == [[1], [5], [8], [3], [9], [4], [7], [0], [2], [6]]
    assert seq.round is None and seq.rounds[0].denoising_steps == 10  # committed


# catches: the threshold ignored (planted: the confidence set dropped -> 5 steps, not 2), applied to positions
# below it, or replacing the scheduled reveals instead of adding to them.
def test_confidence_threshold_reveals_every_confident_position_at_once():
    start = first_body([1])
    vocab = len(build_tokenizer(PD_TOKENS))
    # confidence of sharpness s over V tokens: e^s / (e^s + V - 1); s = 8 -> 0.91, s = 6 -> 0.58, s = 0 -> 1/V
    values = [8.0, 0.0, 8.0, 6.0, 0.0, 8.0, 0.0, 0.0, 6.0, 0.0]
    runtime, seq = runtime_with([1], body_sharpness(start, values), pd_steps_ratio=0.5, pd_confidence=0.9)
    assert abs(torch.tensor(8.0).exp() / (torch.tensor(8.0).exp() + vocab - 1) - 0.91) < 0.01
    steps = reveal_steps(runtime, seq)
    # ratio 0.5: 5 steps for 10 tokens. Step 1: ceil(10 / 5) = 2 scheduled (0 and 2, the sharpest, earliest) and
    # every position >= 0.9 (0, 2, 5); step 2: ceil(7 / 4) = 2 (3 and 8, sharpness 6; none >= 0.9 left); then
    # ceil(5 / 3) = 2 (1, 4), ceil(3 / 2) = 2 (6, 7), ceil(1 / 1) = 1 (9)
    assert [sorted(o for _, o in s) for s in steps] == [[0, 2, 5], [3, 8], [1, 4], [6, 7], [9]]


# catches: one step budget for the whole round instead of one per span (planted: every span given the longest
# span's budget -> the short span reveals one a step and ends with the long one), the ratio not applied.
def test_steps_scale_with_span_length():
    runtime, seq = runtime_with([1, 3], {}, pd_steps_ratio=0.5)
    assert [s.budget for s in seq.round.spans] == [5, 15]  # ceil(0.5 x 10), ceil(0.5 x 30)
    steps = reveal_steps(runtime, seq)
    per_span = [[len([o for k, o in s if k == span]) for s in steps] for span in (0, 1)]
    assert per_span[0] == [2] * 5 + [0] * 10  # 10 tokens in 5 steps
    assert per_span[1] == [2] * 15  # 30 tokens in 15 steps
    assert len(steps) == 15 and seq.rounds[0].denoising_steps == 15


# catches: the uniform order not a permutation of the span, or not the request's own (a different draw per seed
# and the same for the same seed).
def test_uniform_order_is_seeded_and_reveals_every_position_once():
    orders = []
    for _ in range(2):
        runtime, seq = runtime_with([1], {}, pd_steps_ratio=1.0, pd_order="uniform")
        orders.append([o for s in reveal_steps(runtime, seq) for _, o in s])
    assert orders[0] == orders[1] and sorted(orders[0]) == list(range(10)) and orders[0] != list(range(10))
