"""Is a left-padded batch's gradient finite? One forward/backward of transformers' model per attention kind.

    python benchmarks/padded_grad.py --model DIR [--batch 8] [--max-len 1024] [--device cuda]

The question behind it: TRL's GRPO step on the H200 logged ``grad_norm nan`` with a finite loss (issue 15,
docs/notebook/benchmarks.md), while sliderl's learner trains the same model there with finite gradients. TRL left-pads
prompts and right-pads completions in one batch; sliderl packs traces without padding. This script takes
``--batch`` random token sequences of lengths spread up to ``--max-len``, and for each attention implementation
(``sdpa``, ``eager``) and each layout (``padded``: left-padded with an attention mask, as TRL's batch;
``unpadded``: each sequence alone) runs the model under bf16 autocast with gradient checkpointing (float32
weights, as TRL's run), a mean log-prob loss over the real tokens, backward, and prints the loss and the
gradient norm. A nan in one cell and not in its neighbours names the cause.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def one_pass(model, ids: torch.Tensor, mask: torch.Tensor, device: str) -> tuple[float, float]:
    """Loss (mean next-token log-prob of the real tokens, negated) and the gradient norm of one backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    keep = (mask[:, 1:] * mask[:, :-1]).float()
    loss = -(logp * keep).sum() / keep.sum()
    loss.backward()
    norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return loss.item(), norm.item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    gen = torch.Generator().manual_seed(0)
    lengths = [max(8, args.max_len * (i + 1) // args.batch) for i in range(args.batch)]
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]  # the same tokens for both kinds
    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):  # left padding, as TRL's prompts
        ids[i, width - len(s):], mask[i, width - len(s):] = s, 1
    rows = []
    for attn in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=attn)
        model.to(args.device).train()
        model.gradient_checkpointing_enable()
        loss, norm = one_pass(model, ids.to(args.device), mask.to(args.device), args.device)
        rows.append({"attn": attn, "layout": "padded", "loss": loss, "grad_norm": norm})
        norms = []
        for s in seqs:
            one = s[None].to(args.device)
            norms.append(one_pass(model, one, torch.ones_like(one), args.device)[1])
        rows.append({"attn": attn, "layout": "unpadded", "loss": None,
                     "grad_norm": max(norms) if all(map(math.isfinite, norms)) else float("nan")})
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        print(json.dumps(row))
    print(f"{'attn':<6} {'layout':<9} {'loss':>8} {'grad_norm':>10}")
    for r in rows:
        loss = "-" if r["loss"] is None else f"{r['loss']:.3f}"
        print(f"{r['attn']:<6} {r['layout']:<9} {loss:>8} {r['grad_norm']:>10.3g}")


if __name__ == "__main__":
    main()
