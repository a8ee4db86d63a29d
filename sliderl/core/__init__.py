"""The ground floor that the engine and the trainer share, so both compute the same function: the
KV-policy rule and death positions (``kv_policy``), the model and its loader (``model``, ``loader``),
vocabulary binding (``vocab``), the sampler's logprob convention (``logprob``), the trace record
(``trace``), the Pasta-Lang grammar and layout (``pasta``) and the tiny-model builder (``tiny``).
Imports only torch, transformers, pyarrow and ``sliderl.kernels``."""
