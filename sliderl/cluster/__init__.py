"""Everything that runs jobs, by role; Ray is imported only here. Floors, bottom up:

- ``errors``, ``records`` (the records that cross process boundaries) and ``config/`` (the job schemas);
- ``storage/``: the run's storage root, the trace log, model files on every node, datasets;
- ``observe/``: the monitor (metrics.jsonl, W&B, plots), Ray metrics, the dashboard's names;
- ``actors/``: each Ray actor beside the function that places it, over one placement module, and weight sync;
- ``eval/``: accuracy of a policy and comparisons of checkpoints x KV policies;
- ``run/``: the driver, the group ledger, the worker pool, a run's checkpoints and plan, SFT jobs;
- ``cli``: the ``sliderl`` command on top."""
