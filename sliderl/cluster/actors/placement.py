"""Ray connection, resource checks, the placement group, and the actors made from plain classes.

The one place where resources from the config become Ray options: ``connect`` starts or joins a
cluster, ``check_resources`` compares the request with what the cluster has (a clear error before
any actor starts), ``reserve`` places one bundle per learner rank and one per rollout worker, and
``make_learner`` (``cluster.actors.learner_group``) / ``make_worker`` / ``make_queue`` create the actors
inside those bundles.
``make_warm_start`` creates the warm start's actor before that, with its own resources. Every actor
is named ``<run label>/<role>`` (``cluster.observe.dashboard``) and the job carries the run's metadata, so
the Ray dashboard's Actors and Jobs pages show the run. Custom
resources (``learner.resources``, ``rollout.resources``, ``warmstart.resources``) pin actors to the
nodes started with them (``ray start --resources='{"node_b": 4}'``).
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.errors import ConfigError
from sliderl.cluster.observe.dashboard import QUEUE, actor_name, job_config

MIN_BUNDLE_CPU = 0.01  # Ray bundles must not be empty


class ResourceError(ConfigError):
    """The cluster cannot hold what the config asks for, or cannot be reached."""


# ----------------------------------------------------------------------------------- connect


def cluster_address(cfg: TrainConfig) -> str | None:
    """The cluster to join: ``ray.address``, else RAY_ADDRESS, else None (start a local one)."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS") or None


def connect(cfg: TrainConfig, metadata: dict[str, str] | None = None) -> bool:
    """Join the configured cluster or start a local Ray; True when this call initialised Ray.

    ``metadata`` (``cluster.observe.dashboard.job_metadata``) goes to the job's config, which the dashboard's
    Jobs page shows (a submitted job's own metadata, given at submission, takes precedence). An existing
    ``ray.init`` in this process is reused as it is (returns False).
    """
    import ray

    if ray.is_initialized():
        return False
    address = cluster_address(cfg)
    job = {} if metadata is None else {"job_config": job_config(metadata)}
    if address is None:  # "local": a new instance, never a `ray start` cluster found on this machine
        dashboard = cfg.monitor.ray_init_kwargs()
        if dashboard["include_dashboard"]:
            dashboard["dashboard_port"] = free_dashboard_port(dashboard["dashboard_host"], dashboard["dashboard_port"])
        start_local_ray(num_cpus=cfg.ray.num_cpus, num_gpus=cfg.ray.num_gpus, **dashboard, **job)
        return True
    check_reachable(address)
    keep_auth_token_private(create=False)
    try:
        ray.init(address=address, **job)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise ResourceError(f"cannot join the Ray cluster at {address!r}: {' '.join(str(err).split())}") from None
    return True


def free_dashboard_port(host: str, port: int, tries: int = 20) -> int:
    """``port``, or when something already listens there (another local run's dashboard: Ray would fail to
    start) the next free one of ``tries``, said on the console. Another process may still take the port
    between this check and Ray's bind; two runs started at the same second can still collide."""
    for candidate in range(port, min(port + tries, 65536)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, candidate))
            except OSError:
                continue
        if candidate != port:
            print(f"sliderl: port {port} on {host} is in use (another Ray dashboard?); this run's dashboard "
                  f"listens on {candidate} (monitor.dashboard_port sets it)", flush=True)
        return candidate
    raise ResourceError(f"monitor.dashboard_port {port} and the {tries - 1} ports after it are in use on {host}; "
                        "set monitor.dashboard_port to a free port or monitor.include_dashboard=false")


# Ray's switch for "this instance is not a cluster": its node IP becomes 127.0.0.1, so GCS, raylet,
# object manager, core workers, agents and metrics endpoints all listen on loopback only, and no
# other node can join. Read by Ray at import time, in this process and in every process Ray starts.
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def start_local_ray(**init_kwargs) -> None:
    """``ray.init(address="local", **init_kwargs)`` with every Ray port bound to 127.0.0.1.

    Ray's token authentication stays as Ray sets it (on by default for a local instance), its token file
    private to this user (``keep_auth_token_private``). A process that imported Ray before this call has
    already read ``LOCAL_ONLY_ENV``; Ray's module constant is then set to the value the variable gives, as
    the import would have.
    """
    os.environ[LOCAL_ONLY_ENV] = "0"
    import ray
    from ray._private import ray_constants

    keep_auth_token_private()
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(address="local", **init_kwargs)


def keep_auth_token_private(create: bool = True) -> Path | None:
    """Ray's token file (``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``) readable by this user only.

    A new local Ray writes the token it generates with the default umask (0644: any user of the machine could
    read it and run code on the cluster), as does ``ray get-auth-token --generate``. Unless authentication is
    off or the token comes from ``RAY_AUTH_TOKEN``: with ``create`` (a new local instance) a missing file is
    created here first (0600, Ray's own generator: the ``ray.init`` that follows reads it); an existing file
    that group or others may read is set to 0600 with a note. Joining a cluster creates nothing (a token the
    cluster does not know would fail). Returns the file, or None when there is none.
    """
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled" or os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
    if not path.exists() and not create:
        return None
    if not path.exists():
        from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

        path.parent.mkdir(parents=True, exist_ok=True)
        # written whole under a private name, then linked in: a process that starts Ray at the same moment (two test
        # workers, two runs) sees no file or a complete one, never an empty one
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".auth_token.")  # mode 0600
        try:
            with os.fdopen(fd, "w") as file:
                file.write(generate_new_authentication_token())
            os.link(tmp, path)
        except FileExistsError:  # another process linked its token meanwhile: that one is used
            pass
        finally:
            os.unlink(tmp)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        os.chmod(path, 0o600)
        print(f"sliderl: Ray's token file {path} was readable by other users (mode {mode:o}); set it to 600",
              flush=True)
    return path


def check_reachable(address: str) -> None:
    """A quick TCP check of ``host:port`` (also ``ray://host:port``); 'auto' is left to Ray."""
    if address == "auto":
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    if parsed.scheme in ("http", "https"):
        raise ResourceError(f"RAY_ADDRESS {address!r} is a dashboard (Jobs API) address; run the job with "
                            f"`ray job submit --address {address} -- sliderl train ...`, or point RAY_ADDRESS at "
                            "the cluster's GCS address (host:6379)")
    if not parsed.hostname or not parsed.port:
        raise ResourceError(f"RAY_ADDRESS {address!r} is not host:port, ray://host:port or auto")
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=3):
            pass
    except OSError as err:
        raise ResourceError(f"cannot reach the Ray cluster at {address!r} ({err.strerror or err}); start one "
                            "with `ray start --head`, or unset RAY_ADDRESS (and ray.address) to run on a "
                            "local Ray instance") from None


# ------------------------------------------------------------------------------- resources


def bundles(cfg: TrainConfig) -> list[dict[str, float]]:
    """Placement-group bundles: one per learner rank first, then one per rollout worker."""
    worker = _bundle(cfg.rollout.num_cpus, cfg.rollout.num_gpus, cfg.rollout.resources)
    return learner_bundles(cfg) + [dict(worker) for _ in range(cfg.rollout.num_workers)]


def learner_bundles(cfg: TrainConfig) -> list[dict[str, float]]:
    """One bundle per learner rank: ``learner.num_cpus/num_gpus/resources``, plus rank r's own
    ``learner.rank_resources[r]`` when given."""
    learner = cfg.learner
    extra = learner.rank_resources or [{}] * learner.num_ranks
    return [_bundle(learner.num_cpus, learner.num_gpus, {**learner.resources, **own}) for own in extra]


def worker_bundle(cfg: TrainConfig, worker_id: int) -> int:
    """The bundle index of rollout worker ``worker_id`` (after the learner ranks')."""
    return cfg.learner.num_ranks + worker_id


def _bundle(cpus: float, gpus: float, custom: dict[str, float]) -> dict[str, float]:
    bundle = {"CPU": max(cpus, MIN_BUNDLE_CPU)}
    if gpus > 0:
        bundle["GPU"] = gpus
    return {**bundle, **{k: v for k, v in custom.items() if v > 0}}


def warm_start_request(cfg: TrainConfig) -> dict[str, float]:
    """What the warm start's actor asks of one node."""
    stage = cfg.warmstart
    return _bundle(stage.num_cpus, stage.num_gpus, stage.resources)


def check_resources(cfg: TrainConfig, total: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """Raise ResourceError when the bundles cannot fit ``total`` (cluster) or any single node."""
    need: dict[str, float] = {}
    for bundle in bundles(cfg):
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount
    for key, amount in need.items():
        have = total.get(key, 0.0)
        if amount > have + 1e-9:
            ranks = f"{cfg.learner.num_ranks} learner ranks x " if cfg.learner.num_ranks > 1 else "learner "
            raise ResourceError(
                f"the job asks for {amount:g} {key} ({ranks}{_amount(cfg.learner, key):g} + "
                f"{cfg.rollout.num_workers} rollout workers x {_amount(cfg.rollout, key):g}) but the Ray cluster "
                f"has {have:g}; {_lower_hint(key)}")
    alone = bundles(cfg) + ([warm_start_request(cfg)] if cfg.warmstart.enabled else [])
    for bundle in alone:
        if not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()) for node in nodes):
            raise ResourceError(f"no node of the Ray cluster can hold one actor's bundle {bundle}; "
                                f"node resources: {[{k: node.get(k, 0) for k in bundle} for node in nodes]}")
    if cfg.ray.placement_strategy == "STRICT_PACK":
        if not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in need.items()) for node in nodes):
            raise ResourceError(f"placement_strategy STRICT_PACK needs one node with {need}; none has it")


def _amount(section, key: str) -> float:
    return {"CPU": section.num_cpus, "GPU": section.num_gpus}.get(key, section.resources.get(key, 0.0))


def _lower_hint(key: str) -> str:
    if key in ("CPU", "GPU"):
        name = f"num_{key.lower()}s"
        return (f"lower learner.{name}, learner.num_ranks, rollout.{name} or rollout.num_workers, or give the "
                f"cluster more (ray.{name} for a local instance)")
    return (f"lower learner.resources.{key} or rollout.resources.{key}, or start nodes with more "
            f"(ray start --resources='{{\"{key}\": N}}')")


def cluster_capacity() -> tuple[dict[str, float], list[dict[str, float]]]:
    """Total resources of the connected cluster and of each alive node."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return dict(ray.cluster_resources()), nodes


def reserve(cfg: TrainConfig):
    """Create the placement group and wait for it; ResourceError when it cannot be placed in time."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles(cfg), strategy=cfg.ray.placement_strategy, name="")
    try:
        ray.get(pg.ready(), timeout=cfg.ray.placement_timeout_s)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise ResourceError(f"the placement group {bundles(cfg)} ({cfg.ray.placement_strategy}) could not be placed "
                            f"within {cfg.ray.placement_timeout_s:g} s: other jobs may hold the resources") from None
    return pg


def release(pg) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(pg)


# ----------------------------------------------------------------------------------- actors


def actor_options(cfg: TrainConfig, role: str, request: dict[str, float], pg=None, index: int = 0) -> dict[str, Any]:
    """Ray options of the run's actor ``role`` asking for ``request`` (a bundle), inside bundle ``index`` of
    ``pg`` if given; named ``<run label>/<role>``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    custom = {k: v for k, v in request.items() if k not in ("CPU", "GPU")}
    options = {"name": actor_name(cfg, role), "num_cpus": request["CPU"], "num_gpus": request.get("GPU", 0),
               "resources": custom, "runtime_env": {"env_vars": dict(cfg.ray.env_vars)}}
    if pg is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
    return options


def make_queue(cfg: TrainConfig):
    """The bounded trace queue (an actor that reserves no CPU)."""
    from ray.util.queue import Queue

    return Queue(maxsize=cfg.rollout.queue_size, actor_options={"num_cpus": 0, "name": actor_name(cfg, QUEUE)})


def torch_threads(cpus: float) -> int:
    return max(1, int(cpus))
