"""`python -m bench.compile_probe`: does `torch.compile` of the decode forward pay on this machine?

For each batch size B it fills a decode batch of B requests on the offline engine, compiles the
model's forward (embeddings to final norm) for pure-decode steps of exactly B rows (inductor,
static shapes, `fullgraph=True`: the attention is one opaque op, engine/attention/opaque.py, so
the graph has no breaks), and times eager and compiled steps interleaved, round by round. Other
steps (prefills) stay eager. The compile time of the first compiled step is printed; inductor
caches its code on disk (TORCHINDUCTOR_CACHE_DIR), so a second run compiles faster.

fp4serve itself has no compile flag: on the 2-core AVX-512 machine of docs/PERF.md the compiled
step was no faster at batch 1 or 32. Run this where the answer may differ.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

# NOTE: engine/ and torch are imported inside the functions (bench/ stays an HTTP client at
# module level, tests/test_layering.py), engine first: it sets OMP_WAIT_POLICY, which OpenMP reads
# once, when torch loads it. Engine types are `Any` here for the same reason.
Engine = Any  # an engine.front.offline.OfflineEngine
Forward = Callable[[Any], Any]  # ForwardBatch -> hidden states


def compiled_decode_forward(engine: Engine, batch_size: int, backend: Any = "inductor") -> tuple[Forward, Forward]:
    """(eager, compiled) forwards for the runner's `graphs.forward` slot; the compiled one
    handles pure-decode batches of `batch_size` rows and defers everything else to eager."""
    import torch

    from engine.attention.opaque import OpaqueAttention
    from engine.cuda_graph import is_pure_decode

    runner = engine.core.runner
    graphs = runner.graphs
    eager: Forward = graphs.forward
    opaque = OpaqueAttention(runner.backend)
    model, kv_caches = runner.model, runner.kv_caches

    def run(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(input_ids, positions, kv_caches, opaque)

    fn = torch.compile(run, backend=backend, dynamic=False, fullgraph=True)

    def compiled(batch: Any) -> torch.Tensor:
        if batch.num_requests != batch_size or not is_pure_decode(batch):
            return eager(batch)
        opaque.plan(batch)
        return fn(batch.input_ids, batch.positions)

    return eager, compiled


def fill_decode_batch(engine: Engine, batch_size: int, prompt_len: int, max_tokens: int) -> list[str]:
    """Request ids of `batch_size` requests, every one decoding."""
    from scheduler.request import SamplingParams

    vocab = engine.core.runner.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    ids = [
        engine.add_request([(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(prompt_len)], params)
        for i in range(batch_size)
    ]
    started: set[str] = set()
    while len(started) < batch_size:
        started.update(out.request_id for out in engine.step())
    for _ in range(2):
        engine.step()
    return ids


def probe(engine: Engine, batch_size: int, prompt_len: int, steps: int, rounds: int) -> dict[str, float]:
    graphs = engine.core.runner.graphs
    ids = fill_decode_batch(engine, batch_size, prompt_len, max_tokens=2 * rounds * (steps + 1) + 8)
    eager, compiled = compiled_decode_forward(engine, batch_size)
    graphs.forward = compiled
    t0 = time.perf_counter()
    engine.step()  # compiles
    compile_s = time.perf_counter() - t0
    times: dict[str, list[tuple[float, float]]] = {"eager": [], "compiled": []}
    try:
        for r in range(rounds):
            for name in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
                graphs.forward = eager if name == "eager" else compiled
                engine.step()
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    engine.step()
                times[name].append(((time.perf_counter() - w0) / steps * 1e3, (time.process_time() - c0) / steps * 1e3))
    finally:
        del graphs.forward  # the class's method shows again
        for request_id in ids:
            engine.abort(request_id)
    result = {"batch_size": batch_size, "compile_s": compile_s}
    for name, pairs in times.items():
        result[f"{name}_wall_ms"] = statistics.median(w for w, _ in pairs)
        result[f"{name}_cpu_ms"] = statistics.median(c for _, c in pairs)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    from engine.config import EngineConfig
    from engine.front.offline import OfflineEngine

    p = argparse.ArgumentParser(prog="python -m bench.compile_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--batch-size", default="1,32", help="decode batch sizes, e.g. 1,32")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens of every request")
    p.add_argument("--steps", type=int, default=10, help="steps timed per round and mode")
    p.add_argument("--rounds", type=int, default=4, help="eager/compiled rounds, interleaved")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.batch_size.split(",")]
    engine = OfflineEngine.from_config(
        EngineConfig(model=args.model, max_num_seqs=max(sizes), max_model_len=2048, kv_cache_memory="512MiB")
    )
    for size in sizes:
        r = probe(engine, size, args.input_len, args.steps, args.rounds)
        print(
            f"batch {size}: compile {r['compile_s']:.1f} s; eager {r['eager_wall_ms']:.1f} ms/step wall, "
            f"{r['eager_cpu_ms']:.1f} CPU; compiled {r['compiled_wall_ms']:.1f} wall, {r['compiled_cpu_ms']:.1f} CPU "
            f"(medians of {args.rounds} rounds of {args.steps} steps)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
