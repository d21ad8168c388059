"""`python -m bench.spec_decode`: the code-edit workload (the prompt holds a source file and asks
for it back with one change) at several concurrencies, with and without n-gram speculative
decoding, back to back in one process, through the offline engine (engine core + processors, no
HTTP). Greedy, so both runs must produce the same text: the script checks it."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

# The engine is imported inside functions (bench/ is an HTTP client at module level), so engines
# and step outputs are typed Any here: an OfflineEngine and EngineCoreOutputs.

SOURCE = Path(__file__).resolve().parents[1] / "engine" / "spec_decode" / "ngram.py"
INSTRUCTION = ("Here is a Python file. Return the whole file unchanged except that the method `propose` is "
               "renamed to `draft`. Output only the code.\n\n")


def code_edit_prompt(engine: Any) -> list[int]:
    text = INSTRUCTION + "```python\n" + SOURCE.read_text() + "```\n"
    tok = engine.tokenizer
    if tok.chat_template:
        return tok.apply_chat_template([{"role": "user", "content": text}])
    return tok.encode(text)


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


def run(
    engine: Any, prompt: list[int], concurrency: int, max_tokens: int, steps: list[Any]
) -> dict[str, Any]:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint folder; default: the demo model")
    p.add_argument("--concurrency", default="1,8", help="comma-separated concurrencies")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per request at most")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="K for the n-gram run")
    p.add_argument("--kv-cache-memory", default="512MiB", help="KV cache size")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    from engine.config import EngineConfig
    from engine.front.offline import OfflineEngine

    rows = []
    for method in (None, "ngram"):
        config = EngineConfig(model=args.model, kv_cache_memory=args.kv_cache_memory, speculative_method=method,
                              num_speculative_tokens=args.num_speculative_tokens, speculative_max_batch=64)
        engine = OfflineEngine.from_config(config)
        prompt = code_edit_prompt(engine)
        steps = record_steps(engine)
        for c in (int(x) for x in args.concurrency.split(",")):
            run(engine, prompt, 1, 8, steps)  # warm-up
            steps.clear()
            row = run(engine, prompt, c, args.max_tokens, steps)
            row["method"] = method or "none"
            row["prompt_tokens"] = len(prompt)
            rows.append(row)
            print(f"method={row['method']:5} c={c} tok/s={row['tok_per_s']:8.2f} tokens={row['output_tokens']} "
                  f"steps={row['steps']} acceptance={row['acceptance']}", flush=True)
    for c in {r["concurrency"] for r in rows}:
        base, spec = [r for r in rows if r["concurrency"] == c]
        same = base["texts"] == spec["texts"]
        print(f"c={c}: speed-up {spec['tok_per_s'] / base['tok_per_s']:.2f}x, identical output: {same}")
        assert same, "greedy output changed under speculation"
    if args.out:
        Path(args.out).write_text(json.dumps([{k: v for k, v in r.items() if k != "texts"} for r in rows], indent=1))


if __name__ == "__main__":
    main()
