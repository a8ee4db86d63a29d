"""Warm start by SFT: a tiny Qwen3 trained on a task's reference solutions, saved as a HF checkpoint.

``warm_start(out_dir, task, ...)`` builds a random tiny model (``rollout.tiny.make_tiny_model``),
trains it with ``trainer.losses.sft_loss`` on completion tokens only, running the model's own
forward (``DecoderLM``) under the visibility of a KV policy (``train_kv``: ``full`` is the causal
mask; ``prefix_sliding:W`` adapts the model to the bounded KV the engine will use), and writes a
Hugging Face directory that ``rollout.LLM`` and ``transformers`` both load.

Training stops early once the greedy accuracy on held-out problems reaches ``target_accuracy``
(see ``WarmStartSettings``): the job's RL then starts from a partly trained model.

The checkpoint lands in ``out_dir/warmstart-<hash of task and settings>``. The marker file
``warmstart.json`` (settings, steps run, held-out accuracy, loss curve, seconds) is written last
and the directory is renamed into place atomically, so a directory with a marker is a finished
checkpoint for exactly those settings: a second call returns it without training.

    python -m trainer.warmstart ~/.cache/sliderl/warmstart    # the embedded job's checkpoint
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from rewards.arith import ArithTask, format_prompt
from rollout.kv_policy import KVPolicy, visible_mask
from trainer.losses import sft_loss

MARKER = "warmstart.json"
WEIGHTS = "model.safetensors"
CHECK_EVERY = 25  # steps between accuracy checks when target_accuracy > 0
CHECK_PROBLEMS = 64  # held-out train problems (never trained on) scored at each check


@dataclass(frozen=True)
class WarmStartSettings:
    """Everything that changes the warm-started weights; hashed into the checkpoint's folder name.

    ``steps`` is the most SFT steps; with ``target_accuracy`` > 0 training stops at the first check
    (every ``CHECK_EVERY`` steps) where the greedy accuracy under ``train_kv`` on ``CHECK_PROBLEMS``
    held-out train problems reaches it, so the model is left partly trained (room for RL) wherever
    the loss's sudden drop happens to fall. The defaults are the embedded job's
    (configs/tiny-arith.yaml): one to three minutes on 2 CPU cores.
    """

    arch: str = "qwen3"
    hidden_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    steps: int = 1500
    lr: float = 1e-2
    batch_size: int = 16
    warmup_steps: int = 20
    weight_decay: float = 0.01
    train_kv: str = "prefix_sliding:24"  # the visibility of the SFT forward; full = causal
    target_accuracy: float = 0.4  # stop once greedy accuracy on held-out problems reaches it; 0 = never
    seed: int = 0  # seed of the random initialisation

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "hidden_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"warm start {name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"warm start lr must be > 0, got {self.lr}")
        if not 0 <= self.target_accuracy <= 1:
            raise ValueError(f"warm start target_accuracy must be in [0, 1] (0: train all steps), "
                             f"got {self.target_accuracy}")
        if self.warmup_steps < 0:
            raise ValueError(f"warm start warmup_steps must be >= 0, got {self.warmup_steps}")
        object.__setattr__(self, "train_kv", KVPolicy.parse(self.train_kv).spec)
        if KVPolicy.parse(self.train_kv).kind == "registers":
            raise ValueError(f"warm start train_kv {self.train_kv!r} is not supported; the arithmetic task has no "
                             "register tokens (use full, prefix_sliding:W, sliding_window:W or streaming:S:W)")

    def fingerprint(self, task: ArithTask) -> str:
        """12 hex digits identifying (task, settings)."""
        blob = json.dumps({"task": dataclasses.asdict(task), "warmstart": dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def warm_start(out_dir: str | Path, task: ArithTask, *, device: str = "cpu", log_every: int = 0,
               **settings) -> Path:
    """The warm-started checkpoint for ``task`` under ``out_dir``; trains it only when it is not there yet.

    ``settings``: the fields of ``WarmStartSettings`` (arch, hidden_size, num_layers, num_heads,
    num_kv_heads, intermediate_size, steps, lr, batch_size, warmup_steps, weight_decay, train_kv,
    seed). ``log_every`` > 0 prints the loss every that many steps. Returns the checkpoint directory.
    """
    known = {f.name for f in dataclasses.fields(WarmStartSettings)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown warm start setting(s) {unknown}; valid: {', '.join(sorted(known))}")
    cfg = WarmStartSettings(**settings)
    path = Path(out_dir).expanduser() / f"warmstart-{cfg.fingerprint(task)}"
    if (path / MARKER).is_file():
        return path
    staging = path.parent / f".{path.name}.training-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        record = train(staging, task, cfg, device=device, log_every=log_every)
        (staging / MARKER).write_text(json.dumps(record, indent=1) + "\n")
        publish(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already unless training or publishing failed
    return path


def publish(staging: Path, path: Path) -> None:
    """Rename the finished ``staging`` folder to ``path``; a finished copy already there wins."""
    try:
        staging.rename(path)
    except OSError:
        if not (path / MARKER).is_file():
            shutil.rmtree(path, ignore_errors=True)  # an unfinished leftover without its marker
            staging.rename(path)
        else:
            shutil.rmtree(staging, ignore_errors=True)


def train(model_dir: Path, task: ArithTask, cfg: WarmStartSettings, *, device: str = "cpu",
          log_every: int = 0) -> dict:
    """Write a random tiny model to ``model_dir``, SFT it in place; return the marker record.

    Step s trains on train problems ``s*B .. (s+1)*B - 1`` of ``task`` (B = batch_size): every
    problem is seen once, in the task's order; the accuracy checks use the problems after those.
    """
    from rollout.loader import load_tokenizer

    t0, cpu0 = time.perf_counter(), time.process_time()
    model = initial_model(model_dir, task, cfg, device)
    tokenizer = load_tokenizer(model_dir)
    policy = KVPolicy.parse(cfg.train_kv)
    problems = task.problems(cfg.steps * cfg.batch_size + CHECK_PROBLEMS, "train")
    held_out = make_batch(tokenizer, problems[cfg.steps * cfg.batch_size:], policy, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps))
    losses, checks = [], []
    for step in range(1, cfg.steps + 1):
        batch = make_batch(tokenizer, problems[(step - 1) * cfg.batch_size:step * cfg.batch_size], policy, device)
        losses.append(round(sft_step(model, optimizer, batch), 5))
        schedule.step()
        if cfg.target_accuracy and step % CHECK_EVERY == 0:
            checks.append((step, greedy_accuracy(model, held_out)))
        reached = bool(checks) and checks[-1][0] == step and checks[-1][1] >= cfg.target_accuracy
        if log_every and (step % log_every == 0 or step in (1, cfg.steps) or reached):
            accuracy = f"  held-out accuracy {checks[-1][1]:.2f}" if checks else ""
            print(f"warm start step {step}/{cfg.steps}  loss {losses[-1]:.4f}{accuracy}  "
                  f"{time.perf_counter() - t0:.0f}s ({time.process_time() - cpu0:.0f} cpu-s)", flush=True)
        if reached:
            break
    save_weights(model, model_dir)
    return {"task": dataclasses.asdict(task), "warmstart": dataclasses.asdict(cfg), "steps_run": len(losses),
            "held_out_accuracy": checks[-1][1] if checks else None, "checks": checks, "losses": losses,
            "seconds": round(time.perf_counter() - t0, 2), "cpu_seconds": round(time.process_time() - cpu0, 2)}


def initial_model(model_dir: Path, task: ArithTask, cfg: WarmStartSettings, device: str):
    """Write the random-initialised tiny model (seed ``cfg.seed``) to ``model_dir``; load it as a ``DecoderLM``."""
    from rollout.loader import load_model
    from rollout.tiny import make_tiny_model

    make_tiny_model(model_dir, cfg.arch, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                    num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                    intermediate_size=cfg.intermediate_size, seed=cfg.seed,
                    max_position_embeddings=max(512, 2 * max_sequence_tokens(task)))
    return load_model(model_dir, device=device).train()


def sft_step(model, optimizer: torch.optim.Optimizer, batch: SFTBatch) -> float:
    """One AdamW step on the masked NLL of ``batch`` (gradient norm clipped to 1); returns the loss."""
    out = sft_loss(token_logprobs(model, batch), batch.loss_mask)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return out.metrics["loss"]


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then cosine decay to 0.1 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def max_sequence_tokens(task: ArithTask) -> int:
    """An upper bound on prompt + completion tokens of any problem (byte-level: one token per char)."""
    prompt = format_prompt(task.max_value, [("+", task.max_operand)] * task.num_steps[1])
    return len(prompt) + task.max_completion_chars() + 1


# --------------------------------------------------------------------------- batches and forward


@dataclass
class SFTBatch:
    """B right-padded sequences of length T, flattened for the model's token-stream forward.

    input_ids, positions: [B*T]; targets, loss_mask: [B, T] (the target at t is token t+1, and the
    mask is on where that target is a completion token); visible: [B, T, T] bool.
    """

    input_ids: Tensor
    positions: Tensor
    targets: Tensor
    loss_mask: Tensor
    visible: Tensor


def make_batch(tokenizer, rows: list[dict], policy: KVPolicy, device: str | torch.device = "cpu") -> SFTBatch:
    """Tokenise ``prompt`` and ``solution`` + eos of each row; mask and visibility per row."""
    eos = tokenizer.eos_token_id
    seqs = [(tokenizer(r["prompt"]).input_ids, tokenizer(r["solution"]).input_ids + [eos]) for r in rows]
    width = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(rows), width), eos, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    visible = torch.zeros(len(rows), width, width, dtype=torch.bool)
    pos = torch.arange(width)
    for b, (prompt, completion) in enumerate(seqs):
        tokens = prompt + completion
        ids[b, :len(tokens)] = torch.tensor(tokens)
        mask[b, len(prompt) - 1:len(tokens) - 1] = True  # predictions of the completion tokens
        death = policy.death_positions(len(prompt), tokens + [eos] * (width - len(tokens)))
        visible[b] = visible_mask(pos, pos, death)
    targets = torch.cat([ids[:, 1:], torch.full((len(rows), 1), eos)], dim=1)
    return SFTBatch(ids.reshape(-1).to(device), pos.repeat(len(rows)).to(device), targets.to(device),
                    mask.to(device), visible.to(device))


class PaddedAttention:
    """An ``AttentionBackend`` over B equal-length rows of a flat stream, with a per-row mask.

    visible: [B, T, T] bool (query row sees key column). Uses SDPA with GQA.
    """

    def __init__(self, visible: Tensor):
        self.visible = visible[:, None]  # [B, 1, T, T]
        self.batch, self.width = visible.shape[0], visible.shape[1]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, t = self.batch, self.width

        def heads(x: Tensor) -> Tensor:  # [B*T, H, D] -> [B, H, T, D]
            return x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=self.visible, enable_gqa=True)
        return o.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[2])  # [B*T, H_q, D]


def token_logprobs(model, batch: SFTBatch) -> Tensor:
    """log p(target) at every position: [B, T] float32."""
    hidden = model(batch.input_ids, batch.positions, PaddedAttention(batch.visible))  # [B*T, hidden]
    logits = model.compute_logits(hidden).view(*batch.targets.shape, -1)  # [B, T, V]
    return logits.log_softmax(-1).gather(-1, batch.targets[..., None]).squeeze(-1)


@torch.no_grad()
def greedy_accuracy(model, batch: SFTBatch) -> float:
    """Fraction of rows whose every completion token is the model's argmax (teacher forcing).

    A row passes exactly when greedy decoding under the batch's visibility reproduces the reference
    completion, so this is the engine's greedy accuracy under that KV policy (up to argmax ties and
    a different completion that the verifier would also accept), for one forward pass.
    """
    was_training = model.training
    model.eval()
    hidden = model(batch.input_ids, batch.positions, PaddedAttention(batch.visible))
    model.train(was_training)
    predicted = model.compute_logits(hidden).view(*batch.targets.shape, -1).argmax(-1)  # [B, T]
    return ((predicted == batch.targets) | ~batch.loss_mask).all(dim=1).float().mean().item()


def save_weights(model, model_dir: Path) -> None:
    """Overwrite ``model_dir/model.safetensors`` with the model's weights under Hugging Face names."""
    from safetensors.torch import save_file

    tensors = {name: p.detach().contiguous().cpu() for name, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # shared with the embedding; transformers re-ties it
    save_file(tensors, str(model_dir / WEIGHTS), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Warm-start a tiny model on the arithmetic task by SFT "
                                                 "(benchmarks/warmstart.py also scores it per KV policy).")
    parser.add_argument("out_dir", type=Path, help="cache folder; the checkpoint is out_dir/warmstart-<hash>")
    parser.add_argument("--min-steps", type=int, default=ArithTask.num_steps[0], help="fewest steps per problem")
    parser.add_argument("--max-steps", type=int, default=ArithTask.num_steps[1], help="most steps per problem")
    for f in dataclasses.fields(WarmStartSettings):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = parser.parse_args(argv)
    task = ArithTask(num_steps=(args.min_steps, args.max_steps))
    settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(WarmStartSettings)}
    print(warm_start(args.out_dir, task, log_every=50, **settings))


if __name__ == "__main__":
    main()
