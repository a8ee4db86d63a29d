"""Issue 16's warm start at a tenth of the scale, on CPU: how often is the SFT model right, and how nearly.

The register machine of ``configs/long-sft.yaml`` shrunk to 3 variables x 8-10 loop iterations (~270 completion
tokens) under ``prefix_sliding:32`` (T ~ 8 W), the same 0.8M-parameter model (``MODEL=...`` overrides change it),
``STEPS`` SFT steps of 32 pairs, then greedy accuracy on 64 held-out problems under prefix_sliding:32,
sliding_window:32 and full, and the first 16 completions' boxed answers beside the right ones:

    python benchmarks/long_rl_pilot.py as-is 150 /tmp/pilot/as-is     # the task as the benchmark runs it
    python benchmarks/long_rl_pilot.py copy 150 /tmp/pilot/copy       # no prologue: the answer is a's initial value
    python benchmarks/long_rl_pilot.py copy 150 /tmp/pilot/h256 model.hidden_size=256 model.num_heads=8 \\
        model.num_kv_heads=4 model.intermediate_size=1024

``copy`` drops the prologue operation from the prompt and the trace (``a=61 b=47 c=23; 9x b+3 c-2`` -> answer 61):
the answer is then a copy from the prompt, which only the prefix keeps, without the arithmetic.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.accuracy_vs_w import EvalEntry, run_evals  # noqa: E402
from benchmarks.long_rl import RL_RECIPE, SFT_RECIPE, _write, run_logged, write_data  # noqa: E402
from cluster.config import load_config  # noqa: E402
from cluster.sft_config import SFTJobConfig  # noqa: E402

TASK = ["task.num_variables=3", "task.repeats=[8,10]", "task.num_registers=4", "task.lazy_registers=4"]
BOXED = re.compile(r"\\boxed\{(\d+)\}")
CPU = ["engine.device=cpu", "learner.device=cpu", "rollout.num_gpus=0", "learner.num_gpus=0", "rollout.num_cpus=0.5",
       "learner.num_cpus=0.5", "ray.num_cpus=2"]


def without_prologue(row: dict, completion: str | None) -> dict:
    """``row`` with the prologue operation dropped from its prompt (and its completion's first line); the answer
    becomes a's initial value."""
    head, _, loop = row["prompt"].strip().split("; ")
    initial = head.split()[0].split("=")[1]
    row["prompt"] = f"{head}; {loop}\n"
    if completion is None:
        row["answer"] = initial
    else:
        lines = row[completion].split("\n")
        del lines[1]  # the prologue's line, after "<think>"
        row[completion] = re.sub(r"\\boxed\{\d+\}", lambda _: "\\boxed{" + initial + "}", "\n".join(lines))
    return row


def main() -> None:
    variant, steps, out, model = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
    if variant not in ("as-is", "copy"):
        raise SystemExit(f"variant must be as-is or copy, got {variant!r}")
    sft = [*TASK, *model, "model.max_position_embeddings=1024", "learner.device=cpu", "learner.micro_batch_tokens=16384",
           f"sft.steps={steps}", f"sft.check_every={steps}", "sft.log_every=25", "kv=prefix_sliding:32"]
    files = write_data(load_config(SFTJobConfig, str(SFT_RECIPE), sft).task.generator(), out / "data", 32 * steps, 16,
                       64, 2)
    if variant == "copy":
        for name, completion in (("sft", "completion"), ("train", None), ("eval", None)):
            rows = [json.loads(line) for line in files[name].read_text().splitlines()]
            _write(files[name], [without_prologue(r, completion) for r in rows])
    run_logged([sys.executable, "-m", "cluster.cli", "sft", str(SFT_RECIPE), *sft, f"output_dir={out / 'sft'}",
                f"data.source={files['sft']}", "data.prompt_field=prompt", "data.completion_field=completion"],
               out / "sft.log", 3600)
    checkpoint = out / "sft" / "model"
    train = [*TASK, *CPU, "sampling.max_tokens=320", f"data.source={files['train']}", f"data.eval_source={files['eval']}",
             "data.eval_split=train", "model.type=hf", f"model.path={checkpoint}"]
    entries = [EvalEntry(label, str(checkpoint), kv) for label, kv in
               (("ps32", "prefix_sliding:32"), ("sw32", "sliding_window:32"), ("full", "full"))]
    for row in run_evals(entries, str(RL_RECIPE), train, 64, 80, out / "eval", 1, 1800).values():
        print(f"{row['label']:5} accuracy {row['accuracy']:.3f}")

    from rollout.engine import LLM
    from rollout.sampling import SamplingParams

    problems = [json.loads(line) for line in files["eval"].read_text().splitlines()][:16]
    llm = LLM(str(checkpoint), kv="prefix_sliding:32", device="cpu", num_blocks=2000, max_num_seqs=16)
    outputs = llm.generate([p["prompt"] for p in problems], SamplingParams(max_tokens=320, temperature=0.0))
    boxed = [(BOXED.findall(o.text) or ["-"])[-1] for o in outputs]
    print("right/boxed (prefix_sliding:32, greedy):", " ".join(f"{p['answer']}/{b}" for p, b in zip(problems, boxed)))


if __name__ == "__main__":
    main()
