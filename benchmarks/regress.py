"""The headline numbers of docs/results.md measured again, each against its recorded value (GPU).

    python benchmarks/regress.py                      # measure every headline, print recorded vs measured
    python benchmarks/regress.py --only batch1 decode # the headlines whose id starts with these
    python benchmarks/regress.py --record --out DIR   # also write the rows and the new record to DIR
    python benchmarks/regress.py --from DIR           # compare the rows an earlier run left in DIR (no run)

Each headline is one number one benchmark script prints in its JSON rows (``HEADLINES``: the script's
arguments, the row it is read from, higher or lower is better). The recorded values live in
``docs/results/headlines.json`` ({id: {value, unit, commit, machine, raw}}), each beside the raw rows it
was read from; ``--record`` writes a new ``headlines.json`` and the scripts' raw rows into ``--out`` (to be
committed under docs/results/). A measurement worse than its record by more than ``--tolerance`` (10%)
is a drop: the table says DROP and the script exits 1, so the next regression is caught the day it lands.

Benchmarks run once per script (one process each), so a headline costs what its script's run costs:
about 7 minutes for the decode, batch-1 and learner ones on one H200, ~10 more for the MFU rows (the 7B one needs an
H200's memory) and ~3 for h2o's and registers' ratios to prefix_sliding in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "results" / "headlines.json"


@dataclass(frozen=True)
class Run:
    """One benchmark script's run; its rows feed every headline that names it."""

    name: str
    args: tuple[str, ...]  # after the script path; the output file or folder is appended as --out
    rows_file: str  # "" : --out is the JSON file itself; else the file inside the --out folder


@dataclass(frozen=True)
class Headline:
    id: str
    run: str
    match: dict  # the row whose fields equal these
    key: str  # the number, in that row
    unit: str
    higher_is_better: bool = True
    over: dict | None = None  # a ratio: the matched row's number over this row's (another policy in the same run)


RUNS = {
    "decode": Run("decode", ("benchmarks/engine_gpu.py", "--positions", "8192", "32768", "131072", "--policies",
                             "prefix_sliding:4096", "full", "registers:16", "--hf-batch", "0"), ""),
    "batch1": Run("batch1", ("benchmarks/engine_gpu.py", "--positions", "8192", "--policies", "prefix_sliding:4096",
                             "--max-seqs", "1", "--hf-batch", "0", "--steps", "96", "--warmup", "16", "--profile",
                             "32"), ""),
    "learner": Run("learner", ("benchmarks/learner_gpu.py", "--lengths", "32768", "--no-peer", "--rows",
                               "sliderl:truncated:ckpt:32768", "sliderl:full:ckpt:32768"), "rows.jsonl"),
    # issue 38's item 3 rows (docs/results.md, "The MFU target"): compiled, no layer recomputed at 1.7B; the 7B
    # truncated step recomputing 12 of 28 layers (104 GiB: an H200)
    **{f"mfu-1p7b-{mode}": Run(f"mfu-1p7b-{mode}", (
        "benchmarks/learner_scaling.py", "--shape", "1.7b", "--ranks", "1", "--seq", "32768", "--mode", mode,
        "--window", "4096", "--prompt", "128", "--micro-batch-tokens", "32896", "--steps", "2", "--compiled",
        "--checkpoint-layers", "0", "--models", "/tmp/sliderl-models"), "results.jsonl")
       for mode in ("full", "truncated")},
    "mfu-7b": Run("mfu-7b", ("benchmarks/learner_scaling.py", "--shape", "7b", "--ranks", "1", "--seq", "32768",
                             "--mode", "truncated", "--window", "4096", "--prompt", "128", "--no-masters",
                             "--micro-batch-tokens", "16512", "--steps", "2", "--compiled", "--checkpoint-layers",
                             "12", "--models", "/tmp/sliderl-models"), "results.jsonl"),
    # items 4 and 5: h2o and registers at a trained model's kill cadence against prefix_sliding at equal live KV,
    # each a ratio within one run (the card's bandwidth cancels)
    "h2o": Run("h2o", ("benchmarks/engine_gpu.py", "--positions", "32768", "131072", "--policies", "h2o:4096",
                       "prefix_sliding:4096", "--hf-batch", "0", "--steps", "100", "--warmup", "40"), ""),
    "registers-cadence": Run("registers-cadence", (
        "benchmarks/engine_gpu.py", "--positions", "131072", "--policies", "prefix_sliding:4096", "registers:292",
        "--step-tokens", "14", "--hf-batch", "0", "--steps", "100", "--warmup", "40"), ""),
}
PS = "prefix_sliding:4096"

HEADLINES = (
    Headline("decode.prefix_sliding.8k", "decode", {"policy": "prefix_sliding:4096", "position": 8192},
             "tokens_per_s", "tok/s"),
    Headline("decode.prefix_sliding.32k", "decode", {"policy": "prefix_sliding:4096", "position": 32768},
             "tokens_per_s", "tok/s"),
    Headline("decode.prefix_sliding.128k", "decode", {"policy": "prefix_sliding:4096", "position": 131072},
             "tokens_per_s", "tok/s"),
    Headline("decode.full.8k", "decode", {"policy": "full", "position": 8192}, "tokens_per_s", "tok/s"),
    Headline("decode.full.32k", "decode", {"policy": "full", "position": 32768}, "tokens_per_s", "tok/s"),
    Headline("decode.registers16.128k", "decode", {"policy": "registers:16", "position": 131072},
             "tokens_per_s", "tok/s"),
    Headline("batch1.prefix_sliding.8k", "batch1", {"policy": "prefix_sliding:4096", "position": 8192, "batch": 1},
             "tokens_per_s", "tok/s"),
    Headline("learner.truncated.32k.step", "learner", {"name": "sliderl:truncated:ckpt:32768"}, "step_s", "s",
             higher_is_better=False),
    Headline("learner.truncated.32k.mfu", "learner", {"name": "sliderl:truncated:ckpt:32768"}, "mfu", ""),
    Headline("learner.full.32k.step", "learner", {"name": "sliderl:full:ckpt:32768"}, "step_s", "s",
             higher_is_better=False),
    Headline("learner.full.32k.mfu", "learner", {"name": "sliderl:full:ckpt:32768"}, "mfu", ""),
    Headline("mfu.1p7b.full.32k", "mfu-1p7b-full", {"shape": "1.7b", "mode": "full", "status": "ok"}, "mfu", ""),
    Headline("mfu.1p7b.truncated.32k", "mfu-1p7b-truncated", {"shape": "1.7b", "mode": "truncated", "status": "ok"},
             "mfu", ""),
    Headline("mfu.7b.truncated.32k", "mfu-7b", {"shape": "7b", "mode": "truncated", "status": "ok"}, "mfu", ""),
    *(Headline(f"h2o.vs_ps.{k}k", "h2o", {"policy": "h2o:4096", "position": k * 1024}, "tokens_per_s", "x PS",
               over={"policy": PS, "position": k * 1024}) for k in (32, 128)),
    Headline("registers292.cadence14.vs_ps.128k", "registers-cadence", {"policy": "registers:292", "position": 131072},
             "tokens_per_s", "x PS", over={"policy": PS, "position": 131072}),
)


def run_script(run: Run, out: Path) -> list[dict]:
    """Run one benchmark script; its rows (a JSON list, or JSON lines in its --out folder)."""
    target = rows_target(run, out)
    cmd = [sys.executable, *run.args, "--out", str(target)]
    print("regress:", " ".join(cmd), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if run.rows_file:
        target.mkdir(parents=True, exist_ok=True)
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    if code != 0:
        print(f"regress: {run.name} exited {code}", flush=True)
        return []
    return read_rows(run, out)


def rows_target(run: Run, out: Path) -> Path:
    """Where ``run``'s script writes its rows under ``out`` (its ``--out``)."""
    return out / (f"{run.name}.json" if not run.rows_file else run.name)


def read_rows(run: Run, out: Path) -> list[dict]:
    """The rows ``run``'s script left under ``out``; none if it never wrote them (a run cut short)."""
    target = rows_target(run, out)
    path = target / run.rows_file if run.rows_file else target
    if not path.is_file():
        print(f"regress: no rows of {run.name} at {path}", flush=True)
        return []
    if not run.rows_file:
        return json.loads(path.read_text())
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def value_of(headline: Headline, rows: list[dict]) -> float | None:
    """The headline's number from the first row whose fields match, over the ``over`` row's for a ratio; None when a
    row or its number is missing."""
    def number(match: dict) -> float | None:
        for row in rows:
            if all(row.get(k) == v for k, v in match.items()):
                value = row.get(headline.key)
                return float(value) if isinstance(value, (int, float)) else None
        return None
    value = number(headline.match)
    if headline.over is None or value is None:
        return value
    base = number(headline.over)
    return value / base if base else None


def verdict(headline: Headline, recorded: float | None, measured: float | None, tolerance: float) -> str:
    """ok / DROP (worse than the record by more than ``tolerance``) / better / new / missing."""
    if measured is None:
        return "missing"
    if recorded is None:
        return "new"
    ratio = measured / recorded if headline.higher_is_better else recorded / measured
    if ratio < 1 - tolerance:
        return "DROP"
    return "better" if ratio > 1 + tolerance else "ok"


def this_machine() -> str | None:
    """"1x H200" / "1x H100": the card the headlines' scripts run on (GPU 0; each uses one), its name without the
    vendor and memory; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    words = torch.cuda.get_device_name(0).replace("NVIDIA", "").split()
    return f"1x {words[0] if words else 'GPU'}"


def this_commit() -> str:
    """SLIDERL_COMMIT, else git's short HEAD, else "unknown" (a device copy of the tree has no .git)."""
    if os.environ.get("SLIDERL_COMMIT"):
        return os.environ["SLIDERL_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def on_machine(word: str, recorded_on: str | None, machine: str | None) -> str:
    """A verdict between different cards says so instead: an H100's decode is slower than an H200's record by
    its memory bandwidth, not by a regression (the device may lend either)."""
    if word in ("ok", "DROP", "better") and recorded_on and machine and recorded_on != machine:
        return f"other card (recorded on {recorded_on})"
    return word


def table(rows: list[tuple[Headline, float | None, float | None, str]]) -> str:
    lines = [f"{'headline':<36}{'recorded':>12}{'measured':>12}{'ratio':>8}  verdict",
             "-" * 78]
    for h, recorded, measured, word in rows:
        ratio = f"{measured / recorded:.2f}" if recorded and measured else "-"
        fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
        lines.append(f"{h.id:<36}{fmt(recorded):>12}{fmt(measured):>12}{ratio:>8}  {word}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", default=[], help="headline id prefixes to measure")
    parser.add_argument("--tolerance", type=float, default=0.10, help="a drop larger than this fraction fails")
    parser.add_argument("--record", action="store_true", help="write the measured values as the new record")
    parser.add_argument("--out", type=Path, help="where the scripts' rows (and, with --record, headlines.json) go")
    parser.add_argument("--commit", default=None, help="recorded with --record; default SLIDERL_COMMIT or git HEAD")
    parser.add_argument("--machine", default=None,
                        help='the card the rows come from, e.g. "1x H200"; default this machine\'s GPU (with --from: '
                             'none, so no "other card" verdict and "unknown" in a --record)')
    parser.add_argument("--from", dest="source", type=Path, metavar="DIR",
                        help="compare the rows an earlier run wrote to DIR (its --out) instead of running the "
                             "scripts: a device call cut short keeps what finished")
    args = parser.parse_args(argv)
    if args.source is not None and not args.source.is_dir():
        parser.error(f"--from {args.source}: no such folder (give an earlier run's --out)")
    chosen = [h for h in HEADLINES if not args.only or any(h.id.startswith(p) for p in args.only)]
    if not chosen:
        parser.error(f"--only {args.only} matches no headline; ids: {', '.join(h.id for h in HEADLINES)}")
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    out = args.out or args.source or Path(tempfile.mkdtemp(prefix="regress-"))
    out.mkdir(parents=True, exist_ok=True)
    names = dict.fromkeys(h.run for h in chosen)
    # the card first: naming it imports torch (~10 s), which after the last run could outlast a device item's limit
    # and lose the table (2026-12-05: both runs done, the script cut in that import)
    machine = args.machine or (this_machine() if args.source is None else None)
    if args.source is not None:
        rows = {name: read_rows(RUNS[name], args.source) for name in names}
    else:
        rows = {name: run_script(RUNS[name], out) for name in names}
    results = []
    for h in chosen:
        recorded = record.get(h.id, {}).get("value")
        measured = value_of(h, rows[h.run])
        word = verdict(h, recorded, measured, args.tolerance)
        results.append((h, recorded, measured, on_machine(word, record.get(h.id, {}).get("machine"), machine)))
    print(table(results), flush=True)
    if args.record:
        for h, _, measured, _ in results:
            if measured is not None:
                raw = RUNS[h.run]
                record[h.id] = {"value": measured, "unit": h.unit, "commit": args.commit or this_commit(),
                                "machine": machine or "unknown",
                                "raw": f"headlines/{h.run}.json" if not raw.rows_file else f"headlines/{h.run}/{raw.rows_file}"}
        (out / "headlines.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 1 if any(word in ("DROP", "missing") for *_, word in results) else 0


if __name__ == "__main__":
    sys.exit(main())
