"""Watching a run: metrics.jsonl, W&B, the progress bar, plots and the summary (``monitor``), Ray's custom
metrics (``ray_metrics``), and actor names and job metadata for the Ray dashboard (``dashboard``)."""
