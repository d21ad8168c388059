"""`python -m bench.weight_formats --model FOLDER`: decode step time of one model in several weight
formats (dtype and --quantization), each an `OfflineEngine` in this one process, run round by round
in turn so that a noisy neighbour on a shared CPU slows them alike. Per batch size, every round
generates `--output-len` greedy tokens for `--batch` prompts of `--input-len` random token ids; the
decode steps (all but the prefill) are timed one by one, and the median over all rounds is kept."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

# setting name -> (dtype, quantization)
SETTINGS: dict[str, tuple[str, str | None]] = {
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "int8+bf16": ("bfloat16", "int8"),
    "int8+f32": ("float32", "int8"),
    "int4+bf16": ("bfloat16", "int4"),
    # what `--quantization auto --dtype auto` picks for the model (for the built-in SmolLM2 on a CPU:
    # int4 with dense bf16 copies from a row threshold)
    "auto": ("auto", "auto"),
}


def decode_step_times(engine: Any, prompts: list[list[int]], output_len: int) -> list[float]:
    """Seconds of each step of an OfflineEngine after the first (the prefill), with every request decoding."""
    from scheduler.request import SamplingParams  # lazily: bench/ imports the engine only in its functions

    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=0.0)
    for prompt in prompts:
        engine.add_request(prompt, params)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[1:-1]  # the last step only finishes the requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an HF checkpoint folder or a built-in model name")
    p.add_argument(
        "--settings", default="float32,bfloat16,int8+bf16", help="comma separated, of: " + ", ".join(SETTINGS)
    )
    p.add_argument("--batch", default="1,32", help="batch sizes, comma separated")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from engine.config import EngineConfig
    from engine.front.offline import OfflineEngine

    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    engines = {}
    for name in names:
        dtype, quantization = SETTINGS[name]
        engines[name] = OfflineEngine.from_config(
            EngineConfig(
                model=args.model, dtype=dtype, quantization=quantization, kv_cache_memory="256MiB", max_num_seqs=64
            )
        )
    rng = random.Random(0)
    vocab = next(iter(engines.values())).info.vocab_size
    print(
        f"threads {torch.get_num_threads()}; median decode step in ms over {args.rounds} rounds x "
        f"{args.output_len - 2} steps (input {args.input_len}, output {args.output_len})"
    )
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(batch)]
        steps: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                steps[name] += decode_step_times(engine, prompts, args.output_len)
        cells = [
            f"{name} {statistics.median(t) * 1e3:.1f} (p10 {sorted(t)[len(t) // 10] * 1e3:.1f})"
            for name, t in steps.items()
        ]
        print(f"batch {batch}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
