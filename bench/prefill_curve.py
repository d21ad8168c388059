"""Cold prefill time by prompt length: `python -m bench.prefill_curve --lengths 1024,4096,16384`
runs the engine core in-process on the default model (or --model), with prefix caching off, and
reports per length the time to the first token of one fresh prompt, in seconds and in ms per prompt
token, and each length's ms per token against the first length's. `--profile N` instead runs one
N-token prompt under torch.profiler and prints the top ops by self CPU time (where a long prefill
spends its time). `--ab` times each length twice back to back, first with the masked SDPA call a
chunk used to make, then mask-free (engine/attention/torch_ref.py, MASK_FREE_PREFILL). docs/PERF.md
"Long prompts" has the figures."""

from __future__ import annotations

import argparse
import time


def _core(model: str | None, max_len: int, chunk: int) -> object:
    # NOTE: imported here, as bench/__main__.py's offline subcommand does (tests/test_layering.py).
    from engine.config import EngineConfig
    from engine.core import EngineCore

    return EngineCore(
        EngineConfig(
            model=model,
            max_model_len=max_len + 64,
            kv_cache_memory="2GiB",
            max_num_batched_tokens=chunk,
            engine_process=False,
            enable_prefix_caching=False,
        )
    )


def time_prompt(core: object, length: int, seed: int) -> float:
    """Seconds from adding one fresh `length`-token prompt to its first token."""
    from engine.core_types import EngineCoreRequest
    from scheduler.request import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # Distinct prompts per run (seeded), so nothing could be reused even with a prefix cache.
    prompt = tuple(100 + (seed * 7919 + i * 31) % 20000 for i in range(length))
    start = time.monotonic()
    core.add_request(EngineCoreRequest(f"p{seed}-{length}", prompt, one, (), start))  # type: ignore[attr-defined]
    while core.has_unfinished():  # type: ignore[attr-defined]
        core.step()  # type: ignore[attr-defined]
    return time.monotonic() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="a checkpoint folder or built-in name; default: the default model")
    p.add_argument("--lengths", default="1024,4096,16384", help="comma-separated prompt lengths, in tokens")
    p.add_argument("--repeats", type=int, default=1, help="runs per length (the best is reported)")
    p.add_argument("--chunk", type=int, default=4096, help="--max-num-batched-tokens: the prefill chunk")
    p.add_argument("--profile", type=int, default=0, help="profile one prompt of this many tokens instead")
    p.add_argument("--ab", action="store_true", help="each length with the masked chunk attention, then without")
    args = p.parse_args()
    import engine.attention.torch_ref as torch_ref

    lengths = [int(x) for x in args.lengths.split(",")]
    core = _core(args.model, max(lengths + [args.profile]), args.chunk)
    time_prompt(core, 512, seed=10_000)  # warm-up: one-off costs (op loads, first allocations)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            elapsed = time_prompt(core, args.profile, seed=1)
        print(f"{args.profile} tokens: {elapsed:.2f} s")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    print(f"{'attention':>9} {'tokens':>7} {'TTFT s':>8} {'ms/token':>9} {'x first':>8}")
    first: dict[bool, float] = {}
    for length in lengths:
        for mask_free in (False, True) if args.ab else (torch_ref.MASK_FREE_PREFILL,):
            torch_ref.MASK_FREE_PREFILL = mask_free
            best = min(time_prompt(core, length, seed=r) for r in range(args.repeats))
            per_token = 1000 * best / length
            first.setdefault(mask_free, per_token)
            name = "mask-free" if mask_free else "masked"
            print(
                f"{name:>9} {length:>7} {best:>8.2f} {per_token:>9.3f} {per_token / first[mask_free]:>8.2f}", flush=True
            )


if __name__ == "__main__":
    main()
