"""What a run reports and where (``monitor``): the Ray dashboard, Weights & Biases, the console, plots."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from sliderl.cluster.config.base import Section


class WandbConfig(Section):
    """Weights & Biases logging."""

    mode: Literal["offline", "online", "disabled"] = "offline"
    """offline writes the run under run_dir/wandb (upload later with ``wandb sync``); online needs
    an API key (``wandb login`` or WANDB_API_KEY); disabled logs nothing to W&B."""
    project: str = Field("sliderl", min_length=1)
    """W&B project name."""
    entity: str | None = None
    """W&B user or team; None uses the account's default."""
    name: str | None = None
    """Display name of the run; None uses the run directory's name."""
    tags: list[str] = []
    """Tags attached to the run."""


class MonitorConfig(Section):
    """What the run reports and where: Ray dashboard, W&B, console, plots."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases settings."""
    dashboard_host: str = "127.0.0.1"
    """Interface the Ray dashboard binds to when sliderl starts Ray itself; 0.0.0.0 exposes it to
    the network (only do that on a trusted network)."""
    dashboard_port: int = Field(8265, ge=1, le=65535)
    """Port of the Ray dashboard when sliderl starts Ray itself."""
    include_dashboard: bool = True
    """Start the Ray dashboard (and its metrics view) when sliderl starts Ray itself."""
    log_every: int = Field(1, ge=1)
    """Send metrics to W&B every this many steps (and always at the last step); metrics.jsonl and
    the progress bar get every step."""
    plots: bool = True
    """Write reward.png and visible_kv.png into the run directory at the end."""

    def ray_init_kwargs(self) -> dict[str, Any]:
        """Dashboard arguments for ``ray.init`` when starting a local instance (not when connecting
        to an existing cluster, whose dashboard is configured by ``ray start``)."""
        return {"include_dashboard": self.include_dashboard, "dashboard_host": self.dashboard_host,
                "dashboard_port": self.dashboard_port}
