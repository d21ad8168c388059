"""fp4serve's engine: model, KV cache, scheduler loop, sampler, detokenizer."""

import os

# NOTE: must be set before torch starts OpenMP. Spinning OpenMP workers (the default) make a
# small CPU matmul ~30x slower whenever another thread or process wants the core: the HTTP
# loop, a client, a second server. Passive waiting costs nothing measurable when idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
