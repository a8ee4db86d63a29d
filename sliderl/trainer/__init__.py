"""The learner side of sliderl: pure loss functions (GRPO, BoNBoN/IPO, SFT), group advantages and
preference pairs, truncated-window loss masks, logprob recomputation under the trace's KV policy,
and the learner classes that ``cluster/`` wraps as Ray actors. No Ray imports here.
"""
