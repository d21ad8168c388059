"""How --long-prefill-token-threshold trades a long prompt's TTFT against everyone else's
inter-token latency: `python -m bench.prefill_threshold` runs the engine core in-process on the
demo model (or --model), keeps a few short requests decoding, adds one long prompt, and reports,
per threshold, the decoders' worst and mean step time while it prefills and the long prompt's
time to first token. docs/PERF.md "Fair team endpoint" has the figures behind the default."""

from __future__ import annotations

import argparse
import statistics
import time


def measure(model: str | None, threshold: int, long_len: int, num_decoders: int) -> dict[str, float]:
    # NOTE: imported here, as bench/__main__.py's offline subcommand does (tests/test_layering.py).
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.core_types import EngineCoreRequest
    from scheduler.request import SamplingParams

    core = EngineCore(
        EngineConfig(
            model=model,
            max_model_len=long_len + 64,
            kv_cache_memory="512MiB",
            max_num_batched_tokens=4096,
            long_prefill_token_threshold=threshold,
            engine_process=False,
            enable_prefix_caching=False,
        )
    )
    greedy = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # Warm-up: one long prompt through first, so the first measured run pays no one-off costs.
    core.add_request(
        EngineCoreRequest("warm", tuple(200 + i % 500 for i in range(long_len)), long, (), time.monotonic())
    )
    while core.has_unfinished():
        core.step()
    for i in range(num_decoders):
        core.add_request(EngineCoreRequest(f"d{i}", tuple(range(10, 26)), greedy, (), time.monotonic()))
    for _ in range(3):  # the decoders are past their prefill
        core.step()
    start = time.monotonic()
    core.add_request(EngineCoreRequest("long", tuple(100 + i % 500 for i in range(long_len)), long, (), start))
    steps = []
    while True:
        t = time.monotonic()
        out = core.step()
        steps.append(time.monotonic() - t)
        if any(o.request_id == "long" for o in out.outputs):
            break
    return {
        "threshold": threshold,
        "ttft_long_s": time.monotonic() - start,
        "steps": len(steps),
        "max_step_s": max(steps),
        "mean_step_s": statistics.fmean(steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="a checkpoint folder; default: the demo model")
    p.add_argument("--long-len", type=int, default=3072, help="tokens of the long prompt")
    p.add_argument("--decoders", type=int, default=4, help="short requests decoding meanwhile")
    p.add_argument("--thresholds", default="0,2048,1024,512,256", help="comma-separated; 0: no cap")
    args = p.parse_args()
    print(f"{'threshold':>9} {'long TTFT s':>11} {'steps':>5} {'max step s':>10} {'mean step s':>11}")
    for threshold in (int(x) for x in args.thresholds.split(",")):
        r = measure(args.model, threshold, args.long_len, args.decoders)
        print(
            f"{threshold or 'none':>9} {r['ttft_long_s']:>11.3f} {r['steps']:>5} {r['max_step_s']:>10.3f} "
            f"{r['mean_step_s']:>11.3f}"
        )


if __name__ == "__main__":
    main()
