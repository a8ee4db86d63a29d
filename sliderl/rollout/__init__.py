"""The generation engine: paged KV pool, scheduler, model runner, sampling, and the decoding modes behind one
seam (``mode``; Pasta-Lang threads in ``pasta/``). It stands on ``sliderl.core`` (policies, model, traces) and
``sliderl.kernels``; no Ray, no pydantic."""

from sliderl.core.kv_policy import KVPolicy
from sliderl.rollout.engine import LLM
from sliderl.rollout.engine_args import EngineArgs
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.sequence import KVUsage, RequestOutput

__all__ = ["LLM", "EngineArgs", "KVPolicy", "KVUsage", "RequestOutput", "SamplingParams"]
