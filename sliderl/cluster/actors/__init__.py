"""The Ray actors, each beside the function that places it (``make_*``), over one low module of connection,
resources and placement (``placement``): the rollout worker, the learner, the warm start, Baseline-SFT's
length task; and weight sync between them (``weight_sync``)."""
