"""The seam between a rollout worker and its generation engine: ``RolloutEngine`` is every call the
worker (``cluster.actors.rollout_worker``) makes, and ``build_engine`` is the one place an engine is chosen,
by ``rollout.backend`` in the job config.

sliderl's own engine, ``paged`` (``rollout.LLM``), is the only backend: its KV policies bound the
memory of every rollout, and its traces carry what the learner needs to rebuild their visibility
(the policy spec, and under h2o each evicted page's death position). A dense-rollout backend —
vLLM, say, where it is installed — would be a class with the methods below, registered in
``ENGINES`` under its name: it samples under ``full`` only (its ``RequestOutput.kv`` then counts
every token as visible), takes ``EngineArgs`` (and may refuse the fields it has no use for), and
loads the learner's weights from a state dict between steps. Nothing else in the worker or the
driver changes. ``rollout.backend`` is a closed list, so naming a backend that is not registered is
a config error.
"""

from __future__ import annotations

from typing import Any, Protocol

from sliderl.rollout.engine import LLM
from sliderl.rollout.engine_args import EngineArgs
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.sequence import RequestOutput


class RequestHandle(Protocol):
    """What ``add_request`` returns: the worker keys its bookkeeping on these two fields."""

    request_id: int
    num_output: int  # tokens generated so far (the index a mid-request weight update is recorded at)


class RolloutEngine(Protocol):
    """A generation engine as the rollout worker drives it: queue requests, step, read finished outputs,
    take new weights between steps, free its cache while a colocated learner steps."""

    args: EngineArgs
    device: Any  # torch.device of the weights, where weight sync delivers new ones
    policy: Any  # core.kv_policy.KVPolicy; its ``spec`` is written on every trace
    asleep: bool  # True between sleep() and wake()

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> RequestHandle: ...

    def step(self) -> list[RequestHandle]:
        """One engine step; the requests that finished in it."""

    def output(self, request: RequestHandle) -> RequestOutput: ...

    def has_unfinished(self) -> bool: ...

    def load_weights(self, weights) -> None:
        """New weights (a state dict or (name, tensor) pairs), applied before the next step."""

    def sleep(self) -> None:
        """Free the KV cache (and anything captured over it) while no request runs; ``wake`` restores it."""

    def wake(self) -> None: ...

    def close(self) -> None: ...


ENGINES: dict[str, type] = {"paged": LLM}
"""Backend name -> engine class, built as ``cls(model_path, args=EngineArgs)``."""


def build_engine(backend: str, model: str, args: EngineArgs) -> RolloutEngine:
    """The engine ``backend`` names, loading ``model`` (a local Hugging Face folder) with ``args``."""
    if backend not in ENGINES:
        raise ValueError(f"unknown rollout backend {backend!r}; valid: {', '.join(ENGINES)}")
    return ENGINES[backend](model, args=args)
