"""The kill cadence of trained register models: tokens between consecutive register tokens in their traces.

Issue 38 (item 5) asks for the registers-vs-prefix_sliding decode speed measured at the cadence a trained TIP
model kills its steps, not only at ``benchmarks/engine_gpu.py``'s synthetic one register per 256 tokens. This
reads the traces a TIP run's stage 2 wrote (Parquet, ``RUN/traces/*.parquet``), finds every register token
(``<reg_i>`` of the trace's ``registers:N`` policy, by the run's own tokenizer) and reports the gaps: one row per
run, with mean, median, p10 and p90. The engine's ``--step-tokens`` takes the mean; at equal live KV W a policy
then needs W / mean registers.

    python benchmarks/register_cadence.py runs/tip-fair/s0/grpo runs/tip-fair/s1/grpo runs/tip-fair/s2/grpo \
        --out docs/results/engine/register-cadence.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from sliderl.core.kv_policy import KVPolicy, register_tokens


def cadence(run: Path) -> dict:
    """Gaps between consecutive register tokens over every trace of ``run`` (a train run's directory)."""
    from transformers import AutoTokenizer

    files = sorted((run / "traces").glob("*.parquet"))
    if not files:
        raise SystemExit(f"{run}: no traces/*.parquet (give a train run's directory)")
    rows = [r for f in files for r in pq.read_table(f, columns=["kv_policy", "completion_token_ids"]).to_pylist()]
    policy = KVPolicy.parse(rows[0]["kv_policy"])
    if policy.kind != "registers":
        raise SystemExit(f"{run}: traces under {policy.spec}, not registers:N")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir(run)))
    ids = set(tokenizer.convert_tokens_to_ids(register_tokens(policy.num_registers)))
    gaps, lengths = [], []
    for r in rows:
        pos = [i for i, t in enumerate(r["completion_token_ids"]) if t in ids]
        gaps.extend(np.diff(pos).tolist())
        lengths.append(len(r["completion_token_ids"]))
    g = np.asarray(gaps, dtype=float)
    return {"run": str(run), "policy": policy.spec, "traces": len(rows), "mean_tokens": float(np.mean(lengths)),
            "gaps": int(g.size), "gap_mean": float(g.mean()), "gap_median": float(np.median(g)),
            "gap_p10": float(np.percentile(g, 10)), "gap_p90": float(np.percentile(g, 90))}


def tokenizer_dir(run: Path) -> Path:
    """The run's newest checkpoint (its tokenizer holds the register tokens)."""
    checkpoints = sorted((run / "checkpoints").glob("step_*"))
    if not checkpoints:
        raise SystemExit(f"{run}: no checkpoints/step_* with a tokenizer")
    return checkpoints[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = [cadence(run) for run in args.runs]
    for r in rows:
        print(json.dumps(r))
    print(f"mean gap over runs: {np.mean([r['gap_mean'] for r in rows]):.2f} tokens")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
