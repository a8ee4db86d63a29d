"""The rollout side: the paged-KV generation engine, its KV policies, models and sampling."""

from rollout.engine import LLM
from rollout.kv_policy import KVPolicy
from rollout.sampling import SamplingParams
from rollout.sequence import KVUsage, RequestOutput

__all__ = ["LLM", "KVPolicy", "KVUsage", "RequestOutput", "SamplingParams"]
