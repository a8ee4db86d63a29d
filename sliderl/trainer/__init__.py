"""The learner side: the one ``Learner`` (GRPO, BoNBoN, SFT) and its records, pure loss functions, group
advantages and preference pairs, training windows and loss masks, training attention and logprob recomputation
under each trace's KV policy, checkpoints and the SFT stage. Stands on ``sliderl.core``; never imports the
engine; no Ray (``cluster/`` wraps the Learner in an actor).
"""
