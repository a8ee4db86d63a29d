"""Every mistake a user can make in a job's config ends `sliderl train` before Ray starts: exit 2, one line.

And `sliderl train --help` shows the values the job's actors are built with (the records that cross
the actor boundary), not the library defaults.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from sliderl.cluster.cli import main
from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig

# Each case is one mistake from the list, with the words the one-line message must hold.
USER_ERRORS = [
    # an unknown reward term: once surfaced as "rollout worker 0 did not start: The actor died"
    (["reward.acc=1.0"], ["reward: unknown key 'acc'", "valid keys: correctness, kv_penalty, thinking_penalty, speedup, cost_penalty"]),
    # a misspelt option of a reward term
    (["reward.kv_penalty.budgt=64"], ["reward.kv_penalty: unknown key 'budgt'", "did you mean 'budget'", "weight"]),
    # an old config's second multiplier: refused with the new spelling (coef was folded into weight)
    (["reward.kv_penalty.coef=0.5"], ["reward.kv_penalty: key 'coef' is no longer valid", "weight x coef"]),
    # an ill-formed option of a reward term
    (["reward.kv_penalty.budget=-1"], ["reward.kv_penalty", "budget must be > 0, got -1"]),
    # an unknown GRPO option: once "the learner died ... and no checkpoint exists"
    (["learner.algo.clip_lo=0.1"], ["learner.algo: unknown key 'clip_lo'", "did you mean 'clip_low'", "clip_high"]),
    # an ill-formed GRPO option
    (["learner.algo.clip_low=-1"], ["learner.algo", "clip_low", "-1"]),
    # an unknown algorithm
    (["learner.algo.type=ppo"],
     ["learner.algo.type must be one of 'grpo', 'bonbon', 'sft', 'planned_diffusion', got 'ppo'"]),
    # a BoNBoN option given to GRPO
    (["learner.algo.alpha=0.1"], ["learner.algo: unknown key 'alpha'"]),
    # a CUDA device torch does not have here (the test machines have at most a few GPUs)
    (["engine.device=cuda:99"], ["engine.device=cuda:99 but this machine's torch has", "use engine.device=cpu"]),
    (["learner.device=cuda:99"], ["learner.device=cuda:99 but this machine's torch has", "use learner.device=cpu"]),
    # the warm start is an SFT stage: another algorithm there is a mistake
    (["warmstart.learner.algo.type=grpo"], ["warmstart.learner: an SFT stage trains with algo type sft, got 'grpo'"]),
    # rollout seeds come from train.seed; a sampling seed would be ignored
    (["sampling.seed=3"], ["sampling.seed=3: rollout seeds come from train.seed"]),
    # a raw template and the chat template at once: one of them would be silently ignored
    (['data.template="Q: {prompt}"', "data.chat_template=true"],
     ["data: template='Q: {prompt}' asks for raw prompts and chat_template=true", "set one of them"]),
    # a chat-only setting with raw prompts
    (["data.chat_template=false", "data.enable_thinking=false"],
     ["enable_thinking=False only applies to chat-templated prompts"]),
    # a data file that is not there: once found only when the run read it
    (["task.type=math", "warmstart.enabled=false", "data.source=/nonexistent/problems.jsonl"],
     ["data.source: dataset '/nonexistent/problems.jsonl' does not exist"]),
    (["warmstart.data.source=pairs/missing.parquet"], ["warmstart.data.source: dataset 'pairs/missing.parquet' does not exist"]),
    # issue 37: settings that passed validation and failed minutes later inside an actor (planted: dropping
    # TrainConfig._check_algorithm, the first four start Ray; without the nccl check the fifth does)
    # - the README's BoNBoN command on a task without Pasta's speedup: "trace has no reward component(s) ['speedup']"
    (["train.mode=sync", "learner.algo.type=bonbon"],
     ["learner.algo.speedup_key='speedup'", "the reward has only correctness", "learner.algo.speedup_key=null"]),
    (["learner.algo={type: bonbon, speedup_key: null, quality_key: kv_penalty}"],
     ["learner.algo.quality_key='kv_penalty'", "set a term of the reward"]),
    # - pasta traces train on the whole trace only: the learner raised at its first step
    (["engine.kv=pasta", "learner.window_mode=truncated"],
     ["engine.kv=pasta trains on the whole trace only", "learner.window_mode=truncated", "learner.window_mode=full"]),
    # - a group of one has no reward variance (GRPO) or no pair (BoNBoN): every step skipped, exit 1 at the end
    (["rollout.group_size=1"], ["rollout.group_size=1 with learner.algo.type=grpo", "rollout.group_size >= 2"]),
    # - NCCL without GPUs: the broadcast group failed to form inside the actors
    (["weight_sync.backend=broadcast", "weight_sync.broadcast_backend=nccl"],
     ["weight_sync.broadcast_backend=nccl", "learner.device and engine.device=cpu", "broadcast_backend=gloo"]),
    # - a window left empty or beyond int range: "Input should be a valid string", or deaths past int32
    (["engine.kv=prefix_sliding:"], ["'prefix_sliding:' has an empty argument", "valid specs: full, prefix_sliding:W"]),
    (["engine.kv=prefix_sliding:99999999999"], ["99999999999 is beyond the largest argument", "use full"]),
]


@pytest.mark.parametrize("overrides, fragments", USER_ERRORS, ids=[c[0][0] for c in USER_ERRORS])
def test_user_error_exits_2_with_one_line_before_ray(overrides, fragments, tmp_path, capsys):
    # Catches: a mistake that is only found inside an actor (after the warm start and the placement
    # group), a traceback instead of one line, or an exit code other than 2. Checked by planting:
    # dropping check_devices() from run_plan.prepare makes the cuda cases start Ray and fail differently.
    import ray

    was_running = ray.is_initialized()
    groups_before = _placement_groups(ray)
    run_dir, cache = tmp_path / "run", tmp_path / "warmstart-cache"
    code = main(["train", *overrides, f"run_dir={run_dir}", f"warmstart.cache_dir={cache}", "ray.num_cpus=1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("sliderl train: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    assert ray.is_initialized() == was_running  # no Ray started, so no actor and no placement group
    assert _placement_groups(ray) == groups_before
    assert not cache.exists() and not run_dir.exists()  # nothing ran: no warm start, no run directory


def test_a_pool_too_small_for_one_request_is_exit_2_before_ray(tmp_path, capsys):
    # Catches (issue 37): engine.num_blocks too small for one sequence at the policy's bound passing validation
    # and failing in the rollout worker ("more than the whole pool"). The recipe's longest prompt (68 byte-level
    # tokens) and 128 tokens under prefix_sliding:24 hold ceil(68/16) + ceil(24/16) + 1 = 8 blocks of 16 tokens
    # at most: 2 blocks hold none. Planted by dropping check_pool from plan.engine_prompts, Ray starts and this
    # fails.
    import ray

    was_running = ray.is_initialized()
    code = main(["train", "engine.num_blocks=2", f"run_dir={tmp_path / 'run'}", "ray.num_cpus=1",
                 f"warmstart.cache_dir={tmp_path / 'cache'}"])
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]  # (building the recipe's tiny model may print its progress first)
    assert code == 2 and err.count("sliderl train: error:") == 1, err
    assert "engine.num_blocks=2 cannot hold one train request" in last and "set engine.num_blocks >= 8" in last, err
    assert ray.is_initialized() == was_running and not (tmp_path / "cache").exists()
    assert "run_dir:" not in out  # the error comes before the config is printed


def test_an_unreachable_ray_address_is_one_line_before_the_config_dump(tmp_path, capsys, monkeypatch):
    # Catches (issue 37): RAY_ADDRESS pointing nowhere reported after a 220-line config dump (the check ran only
    # when connecting). Planted by dropping check_cluster_address from plan.prepare, the config is printed first.
    import socket

    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    code = main(["train", f"run_dir={tmp_path / 'run'}", "warmstart.enabled=false"])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and f"cannot reach the Ray cluster at '127.0.0.1:{port}'" in err, err
    assert out == ""


def test_wandb_asked_for_but_not_installed_is_exit_2_before_ray(tmp_path, capsys, monkeypatch):
    # Catches: monitor.wandb.mode=offline on a machine without wandb (the H200 image) failing with an ImportError
    # traceback from the driver after Ray and the actors started (seen on the device, 2026-12-04). The package is
    # made unimportable the way Python itself spells it (a None in sys.modules). Planted by dropping check_wandb
    # from plan.prepare, Ray starts and this fails.
    import sys

    import ray

    was_running = ray.is_initialized()
    monkeypatch.setitem(sys.modules, "wandb", None)
    code = main(["train", "monitor.wandb.mode=offline", f"run_dir={tmp_path / 'run'}", "ray.num_cpus=1",
                 f"warmstart.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "monitor.wandb.mode=offline needs the wandb package" in err and "monitor.wandb.mode=disabled" in err, err
    assert ray.is_initialized() == was_running


def test_compile_elementwise_on_a_cpu_without_a_compiler_is_exit_2_before_ray(tmp_path, capsys, monkeypatch):
    # Catches learner.compile_elementwise on a CPU learner of a machine with no C++ compiler (CI's kind) failing
    # inside the learner actor at its first step, after Ray and the warm start. The missing compiler is made
    # missing the way a bare machine has it: an empty PATH for the lookup. Planted by dropping
    # check_compile_elementwise from plan.prepare, Ray starts and this fails.
    import ray

    was_running = ray.is_initialized()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code = main(["train", "learner.compile_elementwise=true", f"run_dir={tmp_path / 'run'}", "ray.num_cpus=1",
                 "monitor.wandb.mode=disabled", f"warmstart.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "learner.compile_elementwise=true with learner.device=cpu needs a C++ compiler" in err, err
    assert "learner.compile_elementwise=false" in err and ray.is_initialized() == was_running


def _placement_groups(ray) -> int:
    from ray.util import placement_group_table

    return len(placement_group_table()) if ray.is_initialized() else 0


def test_help_shows_the_values_the_actors_are_built_with(capsys):
    # Catches: --help printing library defaults (lr 1e-05, kv full) while the job runs its recipe's
    # values (lr 5e-4, prefix_sliding:24), or a derived value (the learner's vocab_policy) shown as
    # null while the actor gets another. Checked by planting: rendering help from TrainConfig()
    # instead of the recipe fails on learner.lr and engine.kv.
    assert main(["train", "--help"]) == 0
    shown = dict(re.findall(r"^  ([\w.\[\]]+) = (.+?)  ", capsys.readouterr().out, flags=re.M))
    cfg = load_config(TrainConfig, None)  # what `sliderl train` with no arguments runs
    actors = {"learner": cfg.learner_args(), "engine": cfg.worker_engine_args(0), "sampling": cfg.sampling,
              "reward": cfg.reward}  # what cluster.actors.placement passes to the learner and to worker 0
    checked = 0
    for prefix, record in actors.items():
        for key, value in _leaves(record, prefix):
            assert shown.get(key) == repr(value), key
            checked += 1
    assert checked > 40
    assert shown["learner.lr"] == "0.0005" and shown["engine.kv"] == "'prefix_sliding:24'"
    assert shown["learner.vocab_policy"] == "'prefix_sliding:24'"


def _leaves(record, prefix: str):
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}.{f.name}")
        else:
            yield f"{prefix}.{f.name}", value
