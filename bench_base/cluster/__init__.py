"""Everything that runs jobs: the config schema (``config``, ``train_config``), the ``sliderl`` CLI,
Ray connection and placement (``resources``), the rollout-worker and learner actors, weight sync,
the trace queue and the driver loop (``driver``, ``ledger``, ``worker_pool``), data, checkpoints,
the trace log and monitoring. Ray is imported only here."""
