"""Planned Diffusion in the engine (``kv="planned_diffusion"``): a request plans autoregressively, then its planned
spans denoise in parallel and join its KV, and autoregression resumes. The engine reaches it only through its
decoding-mode seam (``rollout.mode``)."""
