"""The restart baselines behind the engine's mode seam: ``last_k:N:K`` and ``summary:N:S`` (``core.restart``)."""
