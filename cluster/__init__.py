"""Everything that runs jobs: the config schema, the ``sliderl`` CLI, and (later) Ray actors and
placement, the trace queue, weight sync, metrics and checkpoints. Ray is imported only here."""
