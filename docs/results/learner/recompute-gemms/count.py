"""Which GEMMs a recomputed (checkpointed) layer runs again in the backward: the model's own DecoderLM, a tiny
random Qwen3 (hidden 64, 2 layers), every layer checkpointed, CPU. Watches the aten.mm calls of the
backward: a forward GEMM multiplies by the transposed weight (x @ W.t(), a non-contiguous view of W's storage),
the input gradient by W itself (grad @ W, contiguous), the weight gradient not by W at all; a projection whose
forward GEMM runs in the backward was recomputed. Run from the repository root: python docs/results/learner/recompute-gemms/count.py"""
import sys
import tempfile
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, ".")
from sliderl.core.loader import load_model  # noqa: E402
from sliderl.core.tiny import make_tiny_model  # noqa: E402
from sliderl.trainer.attention import MaskedSDPA  # noqa: E402


class MatMuls(TorchDispatchMode):
    def __init__(self, weights: dict):
        super().__init__()
        self.weights = weights  # data_ptr -> name
        self.forward = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            w = args[-1]
            if w.data_ptr() in self.weights and not w.is_contiguous():
                self.forward[self.weights[w.data_ptr()]] += 1
        return func(*args, **(kwargs or {}))


torch.manual_seed(0)
model = load_model(make_tiny_model(tempfile.mkdtemp(), "qwen3", hidden_size=64, num_layers=2,
                                   tie_word_embeddings=False))
model.train()
model.gradient_checkpointing = True
n = 16
weights = {p.data_ptr(): name.removeprefix("model.") for name, p in model.named_parameters()
           if name.endswith("proj.weight")}
hidden = model(torch.randint(0, 200, (n,)), torch.arange(n), MaskedSDPA(None))
with MatMuls(weights) as seen:
    hidden.sum().backward()
for name in weights.values():
    print(f"{name:<36} {'recomputed' if seen.forward[name] else 'not recomputed'}")
