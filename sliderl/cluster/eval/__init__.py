"""Evaluation: accuracy of a policy with the KV cost of its completions (``evaluation``), and comparisons of
checkpoints x KV policies sampled k times (``comparison``, ``report``)."""
