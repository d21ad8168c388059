"""`python -m bench.spec_mtp`: MTP speculative decoding on tiny random Qwen3.5 checkpoints: step
time against acceptance for K = 1..4 beside no speculation, and what the drafting itself costs.

Random weights cannot be told to reach a chosen acceptance, so two checkpoints bracket it (built
with the tests' tiny-checkpoint factory, tests/factories.py + tests/mtp_factory.py):
- "random": random mtp.* weights, acceptance ~0 (every step verifies K drafts and rejects them;
  a hybrid then recomputes the request's last tokens next step);
- "predictable": the target and the MTP head rigged so drafts are often right (make_predictable):
  a high acceptance with the same shapes.
Greedy, concurrency as given, the offline engine (no HTTP); each checkpoint's runs are back to back
in one process and the script checks that every K gives the same text as no speculation.
`--short-max 16,0` runs every K twice more in the same rounds, with the Gated DeltaNet short-row
path (engine/attention/linear_attention.py SHORT_ROW_MAX) on and off (0: every multi-token row chunked), for
before/after ratios on a shared machine; `--method ngram` drafts with n-grams instead of MTP."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.spec_decode import record_steps


def build_checkpoints(dst: Path, hidden: int, layers: int) -> dict[str, Path]:
    from tests.factories import make_hybrid_checkpoint
    from tests.mtp_factory import add_mtp_tensors, make_predictable

    shapes = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=max(4, hidden // 64),
        head_dim=64 if hidden >= 256 else 16,
    )
    return {
        "random": add_mtp_tensors(make_hybrid_checkpoint(dst / "random", **shapes)),
        "predictable": make_predictable(add_mtp_tensors(make_hybrid_checkpoint(dst / "predictable", seed=4, **shapes))),
    }


def record_timings(engine: Any) -> list[Any]:
    """Every step's runner timings (engine/model_runner.py StepTimings) from now on."""
    timings: list[Any] = []
    execute = engine.core.execute

    def recording(out: Any) -> Any:
        result = execute(out)
        timings.append(result.timings)
        return result

    engine.core.execute = recording  # type: ignore[method-assign]
    return timings


class Run:
    """One engine (K drafts, or none) and the fastest of its timed runs."""

    def __init__(
        self,
        path: Path,
        k: int,
        prompts: list[list[int]],
        max_tokens: int,
        method: str = "mtp",
        short_max: int | None = None,
    ) -> None:
        from engine.config import EngineConfig
        from engine.front.offline import OfflineEngine
        from scheduler.request import SamplingParams

        self.k, self.prompts, self.short_max = k, prompts, short_max
        config = EngineConfig(
            model=str(path),
            dtype="float32",
            kv_cache_memory="64MiB",
            enable_prefix_caching=False,
            speculative_method=method if k else None,
            num_speculative_tokens=max(k, 1),
            speculative_max_batch=64,
        )
        self.engine = OfflineEngine.from_config(config)
        if short_max is not None:  # the torch linear-attention backend's route for 2..short_max-token rows
            self.engine.core.runner.backend.linear.short_max = short_max
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        self.steps = record_steps(self.engine)
        self.timings = record_timings(self.engine)
        self.best: tuple[float, list[Any], list[Any], Any] | None = None

    def once(self) -> None:
        self.steps.clear()
        self.timings.clear()
        t0 = time.perf_counter()
        results = self.engine.generate(self.prompts, self.params)
        wall = time.perf_counter() - t0
        if self.best is None or wall < self.best[0]:
            self.best = (wall, list(self.steps), list(self.timings), results)

    def row(self) -> dict[str, Any]:
        assert self.best is not None
        wall, steps, timings, results = self.best
        k = self.k
        tokens = sum(len(r.token_ids[0]) for r in results)
        drafted = sum(sum(s.num_drafts_by_position) for s in steps)
        accepted = sum(sum(s.num_accepted_by_position) for s in steps)
        draft_s = sum(t.draft for t in timings)
        return {
            "k": k,
            "short_max": self.short_max,
            "tok_per_s": round(tokens / wall, 2),
            "steps": len(steps),
            "step_ms": round(1000 * wall / len(steps), 2),
            "tokens_per_step": round(tokens / len(steps), 2),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "draft_ms_per_step": round(1000 * draft_s / len(timings), 2) if k else 0.0,
            "draft_ms_per_draft_token": round(1000 * draft_s / drafted, 3) if drafted else None,
            "texts": [r.token_ids[0] for r in results],
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ks", default="0,1,2,3,4", help="comma-separated K (0: no speculation)")
    p.add_argument("--concurrency", type=int, default=1, help="requests at once")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length")
    p.add_argument("--hidden-size", type=int, default=256, help="tiny model width")
    p.add_argument("--layers", type=int, default=8, help="tiny model depth (3 of 4 layers Gated DeltaNet)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over every K; the fastest run of each is reported")
    p.add_argument("--method", default="mtp", choices=["mtp", "ngram"], help="draft method for K > 0")
    p.add_argument(
        "--short-max",
        default=None,
        help="comma-separated SHORT_ROW_MAX values to compare in the same rounds (0: chunked form only); "
        "default: the engine's own",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.concurrency)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, path in build_checkpoints(Path(tmp), args.hidden_size, args.layers).items():
            shorts = [int(x) for x in args.short_max.split(",")] if args.short_max else [None]
            runs = [
                Run(path, int(k), prompts, args.max_tokens, args.method, short)
                for short in shorts
                for k in args.ks.split(",")
            ]
            for _ in range(args.repeats):  # rounds over every K: load from other jobs hits them alike
                for r in runs:
                    r.once()
            first = runs[0].row()
            for r in runs:
                row = {"checkpoint": kind, "method": args.method, "concurrency": args.concurrency, **r.row()}
                assert row["texts"] == first["texts"], f"{kind}: greedy output changed with K={row['k']}"
                base = next(b for b in runs if b.short_max == r.short_max).row()  # first K of the same route
                row["speed_up"] = round(row["tok_per_s"] / base["tok_per_s"], 2)
                row["vs_first"] = round(row["tok_per_s"] / first["tok_per_s"], 2)
                rows.append(row)
                print(
                    f"{kind:11} short_max={r.short_max} K={row['k']} tok/s={row['tok_per_s']:7.2f} "
                    f"step={row['step_ms']:7.2f} ms "
                    f"tokens/step={row['tokens_per_step']:.2f} acceptance={row['acceptance']} "
                    f"draft={row['draft_ms_per_step']} ms/step ({row['draft_ms_per_draft_token']} ms/draft token) "
                    f"speed-up={row['speed_up']:.2f}x",
                    flush=True,
                )
    if args.out:
        Path(args.out).write_text(json.dumps([{k: v for k, v in r.items() if k != "texts"} for r in rows], indent=1))


if __name__ == "__main__":
    main()
