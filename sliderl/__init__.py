"""sliderl: asynchronous RL on Ray for long-horizon reasoning models with bounded-KV rollouts.

One import package, so that installing sliderl adds one top-level name. Floors, bottom up:

- ``sliderl.core`` and ``sliderl.kernels``: what everything stands on — the KV-policy rule, the model
  and its loader, the trace record, the Pasta grammar; Triton attention kernels and a torch reference;
- ``sliderl.rollout`` (the generation engine), ``sliderl.trainer`` (the Learner and its losses),
  ``sliderl.rewards`` (verifiers and reward terms), ``sliderl.tasks`` (task generators): peers, none
  imports another;
- ``sliderl.cluster``: configs, Ray actors, the driver, storage, observation, evaluation, the CLI.
"""

import time as _time

STARTED = _time.time()  # when this process first imported sliderl: a driver's startup clock (Monitor.first_step_s)
