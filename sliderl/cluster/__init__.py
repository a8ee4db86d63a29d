"""Everything that runs jobs, by role; Ray is imported only here. Floors, bottom up:

- ``errors`` and ``records`` (the records that cross process boundaries);
- ``storage/``: the run's storage root, the trace log, model files on every node, datasets;
- ``config/``: the job schemas, loading YAML plus overrides;
- ``observe/`` (the monitor: metrics.jsonl, W&B, plots; Ray metrics; the dashboard's names) and ``eval/``
  (accuracy of a policy, comparisons of checkpoints x KV policies);
- ``actors/``: each Ray actor beside the function that places it, over one placement module, and weight sync;
- ``run/``: the driver, the group ledger, the worker pool, a run's checkpoints and plan, SFT jobs;
- ``cli``: the ``sliderl`` command on top."""
