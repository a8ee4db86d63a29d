"""Pasta-Lang decoding in the engine (``kv="pasta"``): a request forks threads at promises and joins them at
syncs, all in one KV pool. The engine reaches it only through its decoding-mode seam (``rollout.mode``)."""
