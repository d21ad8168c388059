"""fp4serve's engine: model, KV cache, scheduler loop, sampler, detokenizer."""

import os

# NOTE: must be set before torch starts OpenMP (libgomp reads them once). How OpenMP workers wait
# between parallel regions decides a CPU decode step's speed:
# - libgomp's default spins ~300,000 rounds: a small matmul gets ~30x slower whenever another
#   thread or process wants the core (the HTTP loop, a client, a second server).
# - Passive waiting alone puts every worker to sleep after each op; waking it costs more than a
#   small op's work (quiet 2-core AVX512 EPYC, SmolLM2 int8: batch-1 decode 49 tok/s through the
#   server).
# - A short spin (10,000 rounds, well under a millisecond) before sleeping catches the next op of
#   the same step and still frees the core between steps: 72-84 tok/s at 1 stream, 368-378 against
#   338-340 at 32 (docs/PERF.md "OpenMP: a short spin"). Set GOMP_SPINCOUNT=0 on a machine shared
#   with other busy processes, where any spinning steals their time.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # explicit, it overrides PASSIVE's zero spin
