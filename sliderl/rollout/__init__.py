"""The rollout side: the paged-KV generation engine, its KV policies, models and sampling."""

from sliderl.core.kv_policy import KVPolicy
from sliderl.rollout.engine import LLM
from sliderl.rollout.engine_args import EngineArgs
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.sequence import KVUsage, RequestOutput

__all__ = ["LLM", "EngineArgs", "KVPolicy", "KVUsage", "RequestOutput", "SamplingParams"]
