"""The learner's optimizer: AdamW over the model's parameters, or — for a bf16/fp16 model with
``LearnerArgs.master_weights`` — ``MasterAdamW``, AdamW over float32 master copies of them.

Why masters: AdamW's step on a bf16 weight is computed and stored in bf16, whose spacing near a
weight w is about |w|·2^-8. An update smaller than half of that is rounded away: at lr 1e-6 (a usual
RL learning rate) every AdamW update of a weight of magnitude 0.02 (spacing ~1.2e-4) is ~1e-6, so a
pure-bf16 learner never changes its weights. Masters accumulate the small updates in float32 and the
model's weights are their rounding, so forward and backward still run in bf16. Cost: 4 bytes per
parameter for the masters and 8 (instead of 4) for AdamW's moments, plus a float32 copy of the
gradients during the step.
"""

from __future__ import annotations

import torch


class MasterAdamW(torch.optim.AdamW):
    """AdamW that steps float32 copies of ``params`` (low-precision model parameters) and writes the result back.

    The model's parameters keep their dtype and receive the gradients; ``step`` copies the gradients to
    the masters as float32, steps them, and rounds the masters into the parameters. ``zero_grad`` clears
    the parameters' gradients too. ``state_dict`` carries the masters (``"master_weights"``), so a resume
    continues from the unrounded values; a state dict without them (a plain AdamW's) takes the masters
    from the parameters as they are.
    """

    def __init__(self, params, **adamw):
        self.model_params = list(params)
        masters = [p.detach().float().clone() for p in self.model_params]
        super().__init__(masters, **adamw)

    @property
    def masters(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        for master, p in zip(self.masters, self.model_params):
            master.grad = None if p.grad is None else p.grad.float()
        super().step()
        for master, p in zip(self.masters, self.model_params):
            p.copy_(master)
            master.grad = None

    def state_dict(self) -> dict:
        return {**super().state_dict(), "master_weights": [m.detach().clone() for m in self.masters]}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        with torch.no_grad():
            for master, p, saved in zip(self.masters, self.model_params, masters or [None] * len(self.masters)):
                master.copy_(saved if saved is not None else p.float())
        super().load_state_dict(state_dict)


def make_optimizer(params, lr: float, weight_decay: float, betas: tuple[float, float],
                   master_weights: bool, foreach: bool | None = None) -> torch.optim.Optimizer:
    """AdamW over ``params``; ``MasterAdamW`` when ``master_weights`` and they are not float32 already.
    ``foreach``: torch's choice (None), or False to step one parameter at a time (no temporary the size of
    all the moments: 4 bytes per parameter less at the step's peak)."""
    params = list(params)
    adamw = dict(lr=lr, weight_decay=weight_decay, betas=betas, foreach=foreach)
    if master_weights and params and params[0].dtype != torch.float32:
        return MasterAdamW(params, **adamw)
    return torch.optim.AdamW(params, **adamw)
