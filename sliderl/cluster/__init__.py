"""Everything that runs jobs: the config schema (``config``, ``train_config``), the ``sliderl`` CLI,
Ray connection and placement (``resources``), the rollout-worker and learner actors, weight sync,
the trace queue and the driver loop (``driver``, ``ledger``, ``worker_pool``), data, the run's
storage root (``storage``: a local folder or a URI) and checkpoints (``run_checkpoints``), the model on
every node (``model_files``), the warm start's actor (``warm_start``), the trace log and monitoring
(``step_report``, ``monitor``, ``ray_metrics``). Ray is imported only here."""
