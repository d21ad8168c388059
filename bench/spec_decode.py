"""`python -m bench.spec_decode`: the code-edit workload (the prompt holds a source file and asks
for it back with one change) at several concurrencies, with and without n-gram speculative
decoding, back to back in one process, through the offline engine (engine core + processors, no
HTTP). Greedy, so both runs must produce the same text: the script checks it.

`--workload copy`: a source file, then its first lines again as a plain completion, which the model
continues by copying (prompt lookup's own case).

`--step-rows 1,2,4,8`: instead, the cost of one step by its rows: a request verifying k drafts (a
drafter that always proposes k tokens) runs k + 1 rows through the model each step; ms per step,
wall and process CPU, against the one-row step of the same engine."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

# The engine is imported inside functions (bench/ is an HTTP client at module level), so engines
# and step outputs are typed Any here: an OfflineEngine and EngineCoreOutputs.

SOURCE = Path(__file__).resolve().parents[1] / "engine" / "spec_decode" / "ngram.py"
INSTRUCTION = (
    "Here is a Python file. Return the whole file unchanged except that the method `propose` is "
    "renamed to `draft`. Output only the code.\n\n"
)


# The copy workload: a file, then the start of the same file again, as a plain completion; the
# model continues the copy (prompt lookup's own case). The edit workload asks a chat model to
# return a file with one change, which the default model mostly answers in its own words.
COPY_SOURCE = Path(__file__).resolve().parents[1] / "engine" / "spec_decode" / "rejection.py"
COPY_HEAD_CHARS = 120


def code_edit_prompt(engine: Any) -> list[int]:
    text = INSTRUCTION + "```python\n" + SOURCE.read_text() + "```\n"
    tok = engine.tokenizer
    if tok.chat_template:
        return tok.apply_chat_template([{"role": "user", "content": text}])
    return tok.encode(text)


def copy_prompt(engine: Any) -> list[int]:
    text = COPY_SOURCE.read_text()
    return engine.tokenizer.encode(text + "\n\n# ---- a copy of the file above ----\n" + text[:COPY_HEAD_CHARS])


WORKLOADS = {"edit": code_edit_prompt, "copy": copy_prompt}


def record_steps(engine: Any) -> list[Any]:
    """From now on, every step's core outputs (drafts and acceptances included) are appended to
    the returned list."""
    steps: list[Any] = []
    update = engine.core.update

    def recording(out: Any, result: Any) -> Any:
        step = update(out, result)
        steps.append(step)
        return step

    engine.core.update = recording  # type: ignore[method-assign]
    return steps


def run(engine: Any, prompt: list[int], concurrency: int, max_tokens: int, steps: list[Any]) -> dict[str, Any]:
    """`steps`: record_steps(engine)'s list, cleared by the caller before the run."""
    from scheduler.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    results = engine.generate([prompt] * concurrency, params)
    wall = time.perf_counter() - t0
    num_tokens = sum(len(r.token_ids[0]) for r in results)
    drafted = sum(sum(s.num_drafts_by_position) for s in steps)
    accepted = sum(sum(s.num_accepted_by_position) for s in steps)
    return {
        "concurrency": concurrency,
        "output_tokens": num_tokens,
        "wall_s": round(wall, 3),
        "tok_per_s": round(num_tokens / wall, 2),
        "steps": len(steps),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "texts": [r.texts[0] for r in results],
    }


def step_ms_by_rows(engine: Any, rows: list[int], num_steps: int, context: int) -> list[dict[str, Any]]:
    """ms per engine step of one request verifying rows - 1 drafts each step, after `context` prompt
    tokens. The engine must speculate with at least max(rows) - 1 tokens; its drafter is replaced by
    one that always proposes rows - 1 tokens (the last token again: mostly rejected, which costs
    the same forward as accepted drafts)."""
    from scheduler.request import SamplingParams

    scheduler = engine.core.scheduler
    vocab = engine.core.runner.model_config.vocab_size
    results = []
    for n in rows:
        scheduler.drafter = lambda request_id, tokens, k, n=n: [tokens[-1]] * (n - 1)
        total = (num_steps + 8) * n  # never done early, even with every draft accepted
        params = SamplingParams(max_tokens=total, min_tokens=total, ignore_eos=True, temperature=0.0)
        prompt = [(13 * j) % (vocab - 1) + 1 for j in range(context)]
        request_id = engine.add_request(prompt, params)
        while not engine.step():  # the prefill, until the first token
            pass
        for _ in range(3):
            engine.step()
        best_wall, best_cpu = float("inf"), float("inf")
        for _ in range(num_steps):
            t0, c0 = time.perf_counter(), time.process_time()
            engine.step()
            best_wall = min(best_wall, time.perf_counter() - t0)
            best_cpu = min(best_cpu, time.process_time() - c0)
        engine.abort(request_id)
        results.append({"rows": n, "step_ms": round(best_wall * 1e3, 3), "cpu_ms": round(best_cpu * 1e3, 3)})
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint folder; default: the demo model")
    p.add_argument("--concurrency", default="1,8", help="comma-separated concurrencies")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per request at most")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="K for the n-gram run")
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="edit",
        help="edit: a chat request to return a source file with one change; copy: a file followed "
        "by its first lines again, continued as a plain completion",
    )
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the n-gram run's draft length follows acceptance (--speculative-adaptive; default: the engine's)",
    )
    p.add_argument("--kv-cache-memory", default="512MiB", help="KV cache size")
    p.add_argument(
        "--step-rows", default=None, help="comma-separated rows per step (1 + drafts): time steps by rows instead"
    )
    p.add_argument(
        "--steps", type=int, default=20, help="with --step-rows: timed steps per row count (the fastest counts)"
    )
    p.add_argument("--context", type=int, default=256, help="with --step-rows: prompt tokens before the steps")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the engine's); 1 gives steadier figures on a busy machine",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    from engine.config import EngineConfig
    from engine.front.offline import OfflineEngine

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.step_rows:
        rows = [int(x) for x in args.step_rows.split(",")]
        config = EngineConfig(
            model=args.model,
            kv_cache_memory=args.kv_cache_memory,
            speculative_method="ngram",
            num_speculative_tokens=max(max(rows) - 1, 1),
            speculative_max_batch=64,
            speculative_adaptive=False,  # every step verifies rows - 1 drafts, rejected or not
        )
        table = step_ms_by_rows(OfflineEngine.from_config(config), rows, args.steps, args.context)
        one = table[0]
        for r in table:
            print(
                f"rows={r['rows']} step_ms={r['step_ms']:8.2f} cpu_ms={r['cpu_ms']:8.2f} "
                f"x one row: {r['step_ms'] / one['step_ms']:.2f} (cpu {r['cpu_ms'] / one['cpu_ms']:.2f})",
                flush=True,
            )
        if args.out:
            Path(args.out).write_text(json.dumps(table, indent=1))
        return

    rows = []
    for method in (None, "ngram"):
        config = EngineConfig(
            model=args.model,
            kv_cache_memory=args.kv_cache_memory,
            speculative_method=method,
            num_speculative_tokens=args.num_speculative_tokens,
            speculative_max_batch=64,
            speculative_adaptive=args.adaptive,
        )
        engine = OfflineEngine.from_config(config)
        prompt = WORKLOADS[args.workload](engine)
        steps = record_steps(engine)
        for c in (int(x) for x in args.concurrency.split(",")):
            run(engine, prompt, 1, 8, steps)  # warm-up
            steps.clear()
            row = run(engine, prompt, c, args.max_tokens, steps)
            row["method"] = method or "none"
            row["prompt_tokens"] = len(prompt)
            rows.append(row)
            print(
                f"method={row['method']:5} c={c} tok/s={row['tok_per_s']:8.2f} tokens={row['output_tokens']} "
                f"steps={row['steps']} acceptance={row['acceptance']}",
                flush=True,
            )
    for c in {r["concurrency"] for r in rows}:
        base, spec = [r for r in rows if r["concurrency"] == c]
        same = base["texts"] == spec["texts"]
        print(f"c={c}: speed-up {spec['tok_per_s'] / base['tok_per_s']:.2f}x, identical output: {same}")
        assert same, "greedy output changed under speculation"
    if args.out:
        Path(args.out).write_text(json.dumps([{k: v for k, v in r.items() if k != "texts"} for r in rows], indent=1))


if __name__ == "__main__":
    main()
