"""The sharded learner's test scenarios, and one rank of them run as its own process (``tests/test_parallel.py``).

A scenario is a learner's settings and the batches of groups it steps on, built the same way in the test
(the one-process reference) and in every rank. A rank joins the process group whose rendezvous store the
test serves, runs the named scenarios in order and, on rank 0, saves what the test compares into OUT:
``<name>.pt`` = {"grads": the full clipped gradients after the first step, "metrics": each step's
StepMetrics as a dict, "weights": the full weights after the last step}. ``resume_*`` scenarios save a
checkpoint after the first step (``OUT/<name>.ckpt``, and "saved": the training state then);
``from1_*`` ones start from the checkpoint the test wrote (``OUT/<name>.from``; "loaded": the state
right after loading).

    python tests/learner_ranks.py RANK WORLD ADDRESS OUT SCENARIO [SCENARIO ...]

A collective that never completes fails after the group's timeout; ``faulthandler`` prints every
thread's stack before the test's own deadline.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sliderl.core.trace import Trace  # noqa: E402
from sliderl.trainer.algorithms import BoNBoNOptions, GRPOOptions, SFTOptions  # noqa: E402
from sliderl.trainer.learner_args import LearnerArgs  # noqa: E402

P = 6
TIMEOUT_S = 30.0  # of every collective in these runs


def trace(seed: int, n: int, spec: str, reward: float, *, deaths=(), registers=(), components=None) -> Trace:
    """A random trace of P prompt and ``n`` completion ids (ids in ``registers`` sprinkled in), sampler logprobs
    near -3 so ratios vary, and kv_deaths ``deaths`` for h2o."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (P,), generator=gen).tolist()
    completion = torch.randint(0, 256, (n,), generator=gen).tolist()
    for i, reg in enumerate(registers[:(n - 4) // 7 + 1]):  # a register every 7 tokens, reused: earlier steps die
        completion[3 + 7 * i] = reg
    logprobs = (-3.0 + torch.rand(n, generator=gen)).tolist()
    return Trace(f"t{seed}", f"g{seed // 10}", "p", 0, 0, spec, prompt, completion, logprobs, "length",
                 temperature=0.9, reward=reward, reward_components=dict(components or {}),
                 kv_deaths=[v for r in deaths for v in r])


def register_ids(model: str) -> list[int]:
    """The ids ``<reg_0..2>`` get when a learner with vocab_policy registers:3 adds them to the model's tokenizer."""
    from sliderl.core.kv_policy import KVPolicy
    from sliderl.core.loader import load_tokenizer
    from sliderl.core.vocab import bind_policy_vocab

    policy = bind_policy_vocab(KVPolicy.parse("registers:3"), load_tokenizer(model))
    return list(policy.register_ids)


def policies_batch(model: str, seed: int) -> list[list[Trace]]:
    """Four groups under six KV policies, lengths 20..75 (so units differ in tokens and ranks in micro-batches)."""
    regs = register_ids(model) * 3
    s = seed * 100
    return [
        [trace(s + 1, 40, "prefix_sliding:8", 1.0), trace(s + 2, 75, "prefix_sliding:8", 0.0),
         trace(s + 3, 22, "prefix_sliding:8", 0.5)],
        [trace(s + 11, 30, "sliding_window:8", 0.2), trace(s + 12, 50, "streaming:2:8", 0.9)],
        [trace(s + 21, 33, "full", 0.0), trace(s + 22, 28, "h2o:4", 1.0, deaths=[(8, 12, 20), (14, 16, 30)])],
        [trace(s + 31, 45, "registers:3", 1.0, registers=regs),
         trace(s + 32, 20, "registers:3", 0.0, registers=regs[:2])],
    ]


def pairs_batch(seed: int) -> list[list[Trace]]:
    """Three BoNBoN groups of three samples scored by speedup + correctness (one pair each)."""
    out = []
    for g in range(3):
        group = []
        for i in range(3):
            s = seed * 100 + 10 * g + i
            group.append(trace(s, 18 + 9 * ((g + i) % 3), "full", float(i == g),
                               components={"speedup": 1.0 + 0.3 * i, "correctness": float(i == g)}))
        out.append(group)
    return out


GRPO = dict(lr=1e-4, max_grad_norm=0.05, window=8, multiplier=2, micro_batch_tokens=1)

SCENARIOS = {
    # token-mean GRPO over every KV policy, truncated windows, a unit per micro-batch, clipping active
    "policies": lambda m: (LearnerArgs(algo=GRPOOptions(), vocab_policy="registers:3", **GRPO),
                           [policies_batch(m, 1), policies_batch(m, 2)]),
    # chunked windows (every token trained once), each trace's token mean then the mean over traces
    "chunked": lambda m: (LearnerArgs(algo=GRPOOptions(aggregation="seq_mean_token_mean"), window_mode="chunked",
                                      **{**GRPO, "micro_batch_tokens": 40}),
                          [policies_batch(m, 3)[:2], policies_batch(m, 4)[:2]]),
    # Dr.GRPO's constant normaliser, a k3 KL to the (sharded) reference, activation checkpointing of the first of
    # the two layers (checkpoint_layers: the second keeps its activations inside FSDP2's unsharded forward)
    "constant_kl": lambda m: (LearnerArgs(algo=GRPOOptions(aggregation="constant", constant_norm=64.0, kl_coef=0.1),
                                          gradient_checkpointing=True, checkpoint_layers=1, **GRPO),
                              [policies_batch(m, 5)[:3], policies_batch(m, 6)[:3]]),
    # best-vs-worst pairs, each pair a unit that no split may cut
    "bonbon": lambda m: (LearnerArgs(algo=BoNBoNOptions(alpha=0.1), lr=1e-4, max_grad_norm=1.0, micro_batch_tokens=1),
                         [pairs_batch(1), pairs_batch(2)]),
    "sft": lambda m: (LearnerArgs(algo=SFTOptions(), lr=1e-4, micro_batch_tokens=30),
                      [policies_batch(m, 7)[:2], policies_batch(m, 8)[:2]]),
    # the layers' element-wise chains compiled (compile_elementwise) inside FSDP2's unsharded forward, with
    # activation checkpointing (the test runs the graphs with SLIDERL_COMPILE_BACKEND=aot_eager: CI has no C++
    # compiler for inductor)
    "compiled": lambda m: (LearnerArgs(algo=GRPOOptions(), compile_elementwise=True, gradient_checkpointing=True,
                                       **GRPO), [policies_batch(m, 11)[:3], policies_batch(m, 12)[:3]]),
    # the ranks' gradients summed once a step (gradient_sync: step): each rank adds its micro-batches' (a unit
    # each, 3-5 a rank) unsharded and the last one's backward reduce-scatters the sum
    "step_sync": lambda m: (LearnerArgs(algo=GRPOOptions(), gradient_sync="step", vocab_policy="registers:3", **GRPO),
                            [policies_batch(m, 13), policies_batch(m, 14)]),
    # bf16 compute with float32 masters (FSDP2's sharded float32 parameters vs MasterAdamW)
    "masters": lambda m: (LearnerArgs(algo=GRPOOptions(), dtype="bfloat16", master_weights=True, **GRPO),
                          [policies_batch(m, 9)[:3], policies_batch(m, 10)[:3]]),
}
# on one GPU (RANKS_DEVICE=cuda, one rank: NCCL), bf16 with float32 masters: FSDP2 with its state on the GPU and
# the gradients summed after each micro-batch, and with the state in host memory (CPUOffloadPolicy) and the
# gradients summed once a step (the 7B row of benchmarks/device_session.sh B); the same groups
GPU_SCENARIOS = {
    name: (lambda m, kw=kw: (LearnerArgs(algo=GRPOOptions(), dtype="bfloat16", master_weights=True, device="cuda",
                                         vocab_policy="registers:3", **kw, **GRPO),
                             [policies_batch(m, 15), policies_batch(m, 16)]))
    for name, kw in (("gpu_resident", {}), ("gpu_offload_step", {"offload": "cpu", "gradient_sync": "step"}))
}
# resume scenarios: the same learner and batches as their base, started from a checkpoint after step 1:
# resume_*: the ranks save it (the test resumes it at one rank), from1_*: the test saved it at one rank
RESUMES = {"resume_fp32": "policies", "resume_masters": "masters", "from1_fp32": "policies", "from1_masters": "masters"}


def scenario(name: str, model: str):
    return {**SCENARIOS, **GPU_SCENARIOS}[RESUMES.get(name, name)](model)


def sharded_state(learner) -> dict:
    """The sharded learner's training state, gathered whole: parameters as the optimizer steps them (float32
    masters) and AdamW's state, both by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    params = {n: p.full_tensor().detach().clone() for n, p in learner.model.named_parameters()}
    adamw = get_optimizer_state_dict(learner.model, learner.optimizer, options=StateDictOptions(full_state_dict=True))
    return {"params": params, "adamw": {n: {k: v.detach().clone() for k, v in s.items()}  # AdamW steps in place
                                        for n, s in adamw["state"].items()}}


def full_grads(learner) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in learner.model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name] = grad.detach().float().clone()
    return out


def run(name: str, model: str, out: Path, parallel) -> None:
    from sliderl.trainer.learner import Learner

    args, batches = scenario(name, model)
    start, record = out / f"{name}.from", {}
    if start.is_dir():  # resume: the checkpoint the test saved after step 1 takes the second batch
        learner, batches = Learner.from_checkpoint(start, args=args, parallel=parallel), batches[1:]
        record["loaded"] = sharded_state(learner)
    else:
        learner = Learner(model, args, parallel=parallel)
    record["metrics"] = []
    for groups in batches:
        record["metrics"].append(learner.step(groups).as_dict())
        if "grads" not in record:
            record["grads"] = full_grads(learner)
            if name in RESUMES and not start.is_dir():
                learner.save_checkpoint(out / f"{name}.ckpt")
                record["saved"] = sharded_state(learner)
    from sliderl.trainer.parallel import host_state_bytes

    # what each rank's offload check counts (its shards' elements x 3 states), beside the model's whole size
    record["host_state"] = parallel.gather(host_state_bytes(learner.model))
    record["elements"] = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)  # DTensor: global
    record["weights"] = learner.state_dict()
    record["placements"] = str(next(learner.model.parameters()).placements)  # (Shard(dim=0),); HSDP: Replicate first
    if parallel.rank == 0:
        torch.save(record, out / f"{name}.pt")


def main(rank: int, world: int, address: str, out: Path, names: list[str]) -> None:
    from sliderl.trainer.parallel import FSDPParallel, ProcessGroupSpec, destroy_process_group, process_group_backend

    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(float(os.environ.get("RANKS_STACKS_AFTER_S", 240)), exit=True)
    model = os.environ["RANKS_MODEL"]
    device = os.environ.get("RANKS_DEVICE", "cpu")  # cuda: NCCL, the GPU scenarios
    shard = int(os.environ["RANKS_SHARD"]) if "RANKS_SHARD" in os.environ else None  # HSDP: ranks per copy
    spec = ProcessGroupSpec(address, world, process_group_backend(device),
                            float(os.environ.get("RANKS_TIMEOUT_S", TIMEOUT_S)), shard)
    if names == ["hang"]:
        return hang(rank, model, spec)
    parallel = FSDPParallel.join(spec, rank, torch.device(device))
    try:
        for name in names:
            run(name, model, out, parallel)
        parallel.barrier()  # no rank tears its groups down while a peer still uses them
    finally:
        destroy_process_group()
    # Done, the records written: leave without the interpreter's teardown, where a gloo thread of the 2D mesh's
    # subgroups has aborted a rank (SIGABRT, "terminate called without an active exception") on a loaded machine
    sys.stdout.flush()
    os._exit(0)


def hang(rank: int, model: str, spec) -> None:
    """Every rank builds a ``LearnerActor`` of the group (the actor a run starts); rank 0 steps, the others never
    arrive at the step's first collective. The actor's step exits the process when its collective fails."""
    from sliderl.cluster.actors.learner import LearnerActor

    actor = LearnerActor(model, LearnerArgs(algo=SFTOptions()), "object_store", 1, None, spec, rank)
    if rank != 0:
        time.sleep(3600)
    print(f"rank 0 steps at {time.monotonic():.1f}", flush=True)
    actor.step([[trace(1, 10, "full", 0.0)]])
    print("rank 0: the step returned", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5:])
