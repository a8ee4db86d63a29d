"""Baseline-SFT's response lengths: the numerator of Pasta's theoretical speedup (``reward.speedup``).

Stage 2 of Pasta scores each sampled response by ``speedup + λ·quality`` (thesis §3.4), the speedup being
Baseline-SFT's response length for the same prompt over the response's critical path. At the start of
such a run (before the rollout workers exist) the Baseline-SFT checkpoint (``reward.speedup.baseline_model``)
answers every training prompt once, greedily, under ``kv=full``, with ``sampling.max_tokens`` — on a Ray
task placed as a rollout worker is, so the engine device and node are the workers'. The prompts are the
token ids the rollouts send (the Pasta model's tokenizer is Baseline-SFT's plus the Pasta-Lang tags), and a
length counts every completion token, end of sequence included, as the critical path does.

The lengths go to ``run_dir/baseline_lengths.json`` with what made them (the model's path, the length
limit); a run that finds the file there — a resume, or a restart in the same run_dir — reads it instead of
generating again when it was made by the same model path and limit and covers every training prompt.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from sliderl.cluster.actors.placement import actor_options, bundles, torch_threads, worker_bundle
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.errors import ConfigError
from sliderl.cluster.observe.dashboard import BASELINE
from sliderl.cluster.records import Problem
from sliderl.cluster.storage.model_files import ModelFiles, local_folder
from sliderl.cluster.storage.root import Storage

FILE = "baseline_lengths.json"


@dataclasses.dataclass(frozen=True)
class BaselineLengths:
    """What ``run_dir/baseline_lengths.json`` holds."""

    model: str  # the Baseline-SFT checkpoint (absolute path on the driver's node)
    max_tokens: int
    lengths: dict[str, int]  # prompt id -> completion tokens of the greedy response

    def fits(self, model: str, max_tokens: int, prompt_ids: list[str]) -> bool:
        """Made by ``model`` with ``max_tokens`` and covering every id of ``prompt_ids``."""
        return self.model == model and self.max_tokens == max_tokens and all(p in self.lengths for p in prompt_ids)


def baseline_model_path(cfg: TrainConfig) -> str:
    """The configured Baseline-SFT checkpoint as an absolute path, checked to be a model directory (ConfigError)."""
    path = Path(cfg.reward.speedup.baseline_model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"reward.speedup.baseline_model {cfg.reward.speedup.baseline_model!r} is not a Hugging Face "
                          "model directory (no config.json there); train Baseline-SFT first: sliderl sft "
                          "configs/pasta-sft.yaml kv=full data.task_solution=solution_plain output_dir=runs/pasta-base")
    return str(path.resolve())


def read_lengths(storage: Storage) -> BaselineLengths | None:
    """The run's file, or None when there is none."""
    path = storage.path(FILE)
    if not storage.is_file(path):
        return None
    data = json.loads(storage.read_bytes(path))
    return BaselineLengths(data["model"], int(data["max_tokens"]), {k: int(v) for k, v in data["lengths"].items()})


def write_lengths(storage: Storage, lengths: BaselineLengths) -> None:
    storage.write_bytes(storage.path(FILE), json.dumps(dataclasses.asdict(lengths), indent=1).encode())


def settle_lengths(storage: Storage, model: str, max_tokens: int, problems: list[Problem],
                   generate) -> tuple[list[Problem], bool]:
    """``problems`` with their ``baseline_tokens``, read from the run's file when it fits, else from
    ``generate(prompts) -> lengths`` (one per problem, in order) and written; and whether it generated."""
    ids = [p.prompt_id for p in problems]
    found = read_lengths(storage)
    generated = found is None or not found.fits(model, max_tokens, ids)
    if generated:
        lengths = [int(n) for n in generate([p.engine_prompt for p in problems])]
        if len(lengths) != len(problems) or min(lengths, default=1) < 1:
            raise RuntimeError(f"the baseline gave {len(lengths)} lengths (least {min(lengths, default=0)}) for "
                               f"{len(problems)} prompts; every prompt needs a response of at least one token")
        found = BaselineLengths(model, max_tokens, dict(zip(ids, lengths)))
        write_lengths(storage, found)
    return [dataclasses.replace(p, baseline_tokens=found.lengths[p.prompt_id]) for p in problems], generated


def greedy_lengths(model: ModelFiles | str, engine, sampling, prompts: list, num_threads: int = 1) -> list[int]:
    """Completion tokens of each prompt's greedy response from ``model`` under kv=full (runs where Ray put it)."""
    import torch

    from sliderl.rollout import LLM

    torch.set_num_threads(max(1, num_threads))
    params = dataclasses.replace(sampling, temperature=0.0, seed=0)
    with LLM(local_folder(model), args=dataclasses.replace(engine, kv="full")) as llm:
        vocab = llm.model.config.vocab_size
        bad = next((t for p in prompts if not isinstance(p, str) for t in p if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"a training prompt holds token id {bad}, outside the baseline's vocabulary "
                             f"[0, {vocab}): Baseline-SFT must share the Pasta model's tokenizer (the same base model)")
        return [len(out.token_ids) for out in llm.generate(prompts, params)]


def baseline_lengths(cfg: TrainConfig, plan, multi_node: bool) -> list[Problem]:
    """``plan``'s training problems with Baseline-SFT's lengths (``settle_lengths`` in the run's storage root),
    generated on a Ray task placed like a rollout worker when the run's file does not have them."""
    import ray


    model = plan.baseline_model

    def generate(prompts: list) -> list[int]:
        print(f"sliderl: Baseline-SFT ({model}) answers {len(prompts)} training prompts greedily for the speedup",
              flush=True)
        task, threads = make_baseline_task(cfg)
        return ray.get(task.remote(ModelFiles.ship(model, multi_node), cfg.engine, cfg.sampling, prompts, threads))

    settled, generated = settle_lengths(plan.storage, model, cfg.sampling.max_tokens, plan.train_problems, generate)
    if not generated:
        print(f"sliderl: Baseline-SFT lengths read from {plan.storage.uri(plan.storage.path(FILE))}", flush=True)
    return settled


def make_baseline_task(cfg: TrainConfig):
    """Baseline-SFT's greedy lengths (``cluster.actors.baseline.greedy_lengths``) as a Ray task placed as a rollout
    worker is (before the placement group exists), and its torch thread count."""
    import ray


    request = bundles(cfg)[worker_bundle(cfg, 0)]
    return ray.remote(greedy_lengths).options(max_retries=0, **actor_options(cfg, BASELINE, request)), torch_threads(cfg.rollout.num_cpus)
