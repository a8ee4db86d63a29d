"""One run: what it starts from (``plan``), the driver loop (``driver``), the books on groups (``ledger``), the
rollout workers' health (``worker_pool``), the run's checkpoints (``checkpoints``) and SFT jobs (``sft_job``)."""
