"""The warm starts bundled with sliderl (``trainer.sft.BUNDLED``), and the tool that makes one.

``sliderl train``'s warm start is cached by a fingerprint of everything that shapes its weights
(``trainer.sft.fingerprint``); a finished checkpoint under ``sliderl/assets/warmstart/sft-<key>/`` is used
as a cached one is, on any machine, so the default job starts RL seconds after the command instead of
after a minute of SFT on two cores. A bundle is the stage's own output, made here by the stage itself:

    python -m sliderl.cluster.run.bundle                      # the default job's warm start
    python -m sliderl.cluster.run.bundle configs/X.yaml k=v   # another recipe's

trains the stage exactly as ``sliderl train`` would (always, even when a cache or bundle holds it, so remaking a
bundle shows whether it reproduces: ``git diff`` then shows only the marker's seconds and their manifest line),
then copies its model, tokenizer and marker (not the optimizer state: RL starts its own) into the bundle folder. A
recipe, task, model or learner setting that changes the key leaves the bundle unused (the run trains, as
with an empty cache); ``tests/test_bundled_warmstart.py`` fails then for the default job, so its bundle is
remade in the same change.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from sliderl.trainer.manifest import MANIFEST

LEFT_OUT = ("trainer_state.pt", MANIFEST)  # the SFT optimizer's state (RL starts its own); the manifest names it


def default_key(overrides: list[str] | None = None, config_path: str | None = None,
                run_dir: str | None = None) -> tuple[str, object]:
    """The warm-start key of ``sliderl train [config_path] [overrides]`` and the run's ``RunPlan`` (its run_dir
    ``run_dir``, by default a new temporary folder; the caller calls ``plan.finish()``)."""
    from sliderl.cluster.actors.warm_start import stage_key
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig
    from sliderl.cluster.run.plan import prepare

    run_dir = run_dir or tempfile.mkdtemp(prefix="sliderl-bundle-")
    cfg = load_config(TrainConfig, config_path, [*(overrides or []), f"run_dir={run_dir}",
                                                 "monitor.wandb.mode=disabled"])
    if not cfg.warmstart.enabled:
        raise SystemExit("this recipe has no warm start (warmstart.enabled=false): nothing to bundle")
    plan = prepare(cfg)
    return stage_key(cfg, plan.model_path, plan.warm_start), (cfg, plan)


def make_bundle(config_path: str | None, overrides: list[str]) -> Path:
    """Train the warm start of ``sliderl train [config_path] [overrides]`` in this process (always: neither a cached
    nor a bundled checkpoint is reused, so remaking a bundle checks that it reproduces) and copy it into the bundle
    folder; its path."""
    import torch

    from sliderl.cluster.actors.warm_start import stage_sft_args
    from sliderl.trainer.manifest import Manifest, hash_file
    from sliderl.trainer.sft import BUNDLED, MARKER, run_sft

    scratch = Path(tempfile.mkdtemp(prefix="sliderl-bundle-"))  # the plan's run_dir and the trained stage
    try:
        key, (cfg, plan) = default_key(overrides, config_path, run_dir=str(scratch / "run"))
        try:
            torch.set_num_threads(max(1, int(cfg.warmstart.num_cpus)))
            result = run_sft(plan.model_path, scratch / f"sft-{key}", *plan.warm_start, cfg.engine.kv,
                             cfg.warmstart.learner, stage_sft_args(cfg))
        finally:
            plan.finish()
        target = BUNDLED / f"sft-{key}"
        staging = target.parent / f".{target.name}.staging"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(result.path, staging, ignore=shutil.ignore_patterns(*LEFT_OUT))
        marker = json.loads((staging / MARKER).read_text())
        marker["result"]["path"] = target.name  # not the trainer's staging folder (read_result puts the real one)
        (staging / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        manifest = Manifest()
        for file in sorted(staging.iterdir()):
            manifest.add(file.name, hash_file(file))
        manifest.write(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"bundled {result.line()} -> {target}")
    return target


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    config_path = args.pop(0) if args and "=" not in args[0] else None
    make_bundle(config_path, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
