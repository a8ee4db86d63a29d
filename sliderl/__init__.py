"""sliderl: asynchronous RL on Ray for long-horizon reasoning models with bounded-KV rollouts.

One import package, so that installing sliderl adds one top-level name: ``sliderl.rollout`` (the
engine and the rollout worker), ``sliderl.kernels`` (Triton attention kernels and a torch
reference), ``sliderl.trainer`` (the Learner and its losses), ``sliderl.rewards`` (verifiers,
reward terms, tasks) and ``sliderl.cluster`` (config, CLI, Ray actors).
"""
