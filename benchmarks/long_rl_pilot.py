"""Issue 16's warm start at a tenth of the scale, on CPU: how often is the SFT model right, and how nearly.

The register machine of ``configs/long-sft.yaml`` at ``long_rl.py --scale tenth``'s size: 3 variables x 8-10 loop
iterations (~270 completion tokens) under ``prefix_sliding:32`` (T ~ 8 W), the same 0.8M-parameter model (``--model
KEY=VALUE ...`` changes it), ``--steps`` SFT steps of 32 pairs, then greedy accuracy on 64 held-out problems under
prefix_sliding:16, :32 and :64, sliding_window:32 and full, and the first 16 completions' boxed answers beside the
right ones:

    python benchmarks/long_rl_pilot.py as-is --out /tmp/pilot/as-is        # the task as the benchmark runs it
    python benchmarks/long_rl_pilot.py copy --out /tmp/pilot/copy          # no prologue: the answer is a's initial value
    python benchmarks/long_rl_pilot.py copy --out /tmp/pilot/h256 --model model.hidden_size=256 model.num_heads=8 \
        model.num_kv_heads=4 model.intermediate_size=1024
    python benchmarks/long_rl_pilot.py copy --out /tmp/pilot/trunc --truncated-steps 150   # then 150 steps on the end

``--truncated-steps N`` continues the SFT from its checkpoint for N steps with the loss on each trace's last W
tokens only (``learner.window_mode=truncated``, k·W of context): the answer's tokens are then ~1/16 of the loss
rather than ~1/100 (1/3,000 at the benchmark's 8.3K tokens).

``--mix-steps N`` continues instead under several policies at once (``--mix-kv``, default prefix_sliding:W and
full; example i under the (i mod n)-th), so that one model decodes under each: the full arm's start, and a model
for accuracy vs W that was not trained at one W only. ``--reuse-sft`` skips the first SFT and continues from the
checkpoint already in ``--out``:

    python benchmarks/long_rl_pilot.py copy --out /tmp/pilot/copy --reuse-sft --mix-steps 100

``copy`` is the task without its prologue operation (``task.prologue=false``: ``a=61 b=47 c=23; 9x b+3 c-2`` ->
answer 61, as configs/long-sft.yaml now sets it): the answer is a copy from the prompt, which only the prefix keeps,
without the arithmetic; ``as-is`` keeps the prologue (``a=61 ...; a-4; 9x ...`` -> 57).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.accuracy_vs_w import EvalEntry, run_evals  # noqa: E402
from benchmarks.long_rl import RL_RECIPE, SFT_RECIPE, run_logged, write_data  # noqa: E402
from benchmarks.long_rl_scales import TENTH  # noqa: E402
from sliderl.cluster.config.base import load_config  # noqa: E402
from sliderl.cluster.config.sft import SFTJobConfig  # noqa: E402

BOXED = re.compile(r"\\boxed\{(\d+)\}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variant", choices=("as-is", "copy"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=150, help="SFT steps of 32 pairs on whole traces")
    parser.add_argument("--truncated-steps", type=int, default=0, help="then this many on each trace's last W tokens")
    parser.add_argument("--mix-steps", type=int, default=0, help="then this many with the examples taking turns "
                        "among --mix-kv")
    parser.add_argument("--mix-kv", nargs="+", default=[f"prefix_sliding:{TENTH.window}", "full"], metavar="KV")
    parser.add_argument("--reuse-sft", action="store_true", help="continue from the SFT checkpoint already in --out")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE", help="model settings")
    parser.add_argument("--eval-only", action="store_true", help="evaluate the checkpoints already in --out")
    args = parser.parse_args()
    out, steps = args.out, args.steps
    prologue = f"task.prologue={args.variant == 'as-is'}"
    sft = [*TENTH.sft, prologue, *args.model, f"kv=prefix_sliding:{TENTH.window}", "sft.log_every=25"]
    if args.truncated_steps and args.mix_steps:
        parser.error("--truncated-steps and --mix-steps are two second stages; give one")
    if args.reuse_sft and not (out / "sft" / "model" / "config.json").is_file():
        parser.error(f"--reuse-sft: no SFT checkpoint in {out / 'sft' / 'model'}")
    examples = 32 * (steps + args.truncated_steps + args.mix_steps)
    files = write_data(load_config(SFTJobConfig, str(SFT_RECIPE), sft).task.generator(), out / "data", examples, 16,
                       64, 2)
    data = [f"data.source={files['sft']}", "data.prompt_field=prompt", "data.completion_field=completion"]
    command = [sys.executable, "-m", "sliderl.cluster.cli", "sft", str(SFT_RECIPE), *sft, *data]
    if not (args.eval_only or args.reuse_sft):
        run_logged([*command, f"output_dir={out / 'sft'}", f"sft.steps={steps}", f"sft.check_every={steps}"],
                   out / "sft.log", 3600)
    checkpoint = out / "sft" / "model"
    second = None  # a second stage from the first's checkpoint: (folder, steps, its settings)
    if args.truncated_steps:
        second = ("sft-end", args.truncated_steps, ["learner.window_mode=truncated", "learner.multiplier=4"])
    elif args.mix_steps:
        second = ("sft-mix", args.mix_steps, [f"kv=[{','.join(args.mix_kv)}]"])
    if second is not None:
        name, n, settings = second
        if not args.eval_only:
            run_logged([*command, f"output_dir={out / name}", f"sft.steps={n}", f"sft.check_every={n}",
                        "model.type=hf", f"model.path={checkpoint}", *settings], out / f"{name}.log", 3600)
        checkpoint = out / name / "model"
    train = [*TENTH.train, prologue, f"data.source={files['train']}", f"data.eval_source={files['eval']}",
             "data.eval_split=train", "model.type=hf", f"model.path={checkpoint}"]
    w = TENTH.window
    entries = [EvalEntry(label, str(checkpoint), kv) for label, kv in
               ((f"ps{w // 2}", f"prefix_sliding:{w // 2}"), (f"ps{w}", f"prefix_sliding:{w}"),
                (f"ps{2 * w}", f"prefix_sliding:{2 * w}"), (f"sw{w}", f"sliding_window:{w}"), ("full", "full"))]
    shutil.rmtree(out / "eval", ignore_errors=True)  # an earlier evaluation's folders
    for row in run_evals(entries, str(RL_RECIPE), train, 64, 80, out / "eval", 1, 1800).values():
        print(f"{row['label']:5} accuracy {row['accuracy']:.3f}")

    from sliderl.rollout.engine import LLM
    from sliderl.rollout.sampling import SamplingParams

    problems = [json.loads(line) for line in files["eval"].read_text().splitlines()][:16]
    llm = LLM(str(checkpoint), kv="prefix_sliding:32", device="cpu", num_blocks=2000, max_num_seqs=16)
    outputs = llm.generate([p["prompt"] for p in problems], SamplingParams(max_tokens=320, temperature=0.0))
    boxed = [(BOXED.findall(o.text) or ["-"])[-1] for o in outputs]
    print("right/boxed (prefix_sliding:32, greedy):", " ".join(f"{p['answer']}/{b}" for p, b in zip(problems, boxed)))


if __name__ == "__main__":
    main()
