"""The engine core in a process of its own (the server's default): it streams exactly what the
in-process engine does; when it dies and restarts are off, every in-flight request gets an error,
/health turns 503 and the server exits 1 (tests/engine/test_engine_restart.py: with restarts); SIGTERM
drains and stops it with the server."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from engine.front.async_engine import AsyncEngine
from engine.front.offline import OfflineEngine
from scheduler.request import SamplingParams
from tests.server_utils import DONE, running_server, sse_event

CFG: dict[str, Any] = dict(dtype="float32", kv_cache_memory="8MiB")


def engine_pid(log: str) -> int:
    found = re.search(r"engine core running in process (\d+)", log)
    assert found, log[-2000:]
    return int(found.group(1))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams) -> Any:
    texts, tokens, reasons = [""] * params.n, [[] for _ in range(params.n)], [None] * params.n
    logprobs: list[list[float]] = [[] for _ in range(params.n)]
    async for out in engine.generate(prompt, params, request_id):
        texts[out.index] += out.text_delta
        tokens[out.index].extend(out.new_token_ids)
        logprobs[out.index].extend(lp.logprob for lp in out.logprobs or ())
        if out.finish_reason is not None:
            reasons[out.index] = out.finish_reason
    return texts, tokens, reasons, logprobs


def test_the_engine_process_streams_what_the_in_process_engine_does(qwen3_ckpt: Path) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    offline = OfflineEngine.from_config(EngineConfig(model=str(qwen3_ckpt), **CFG))
    expected = [offline.generate([prompts[0]], greedy)[0], offline.generate([prompts[1]], sampled)[0]]
    # A stop string taken from the greedy text: the engine process keeps going until the front's abort.
    stop_at = expected[0].texts[0][3:6]
    with_stop = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop_at,))
    [expected_stop] = offline.generate([prompts[0]], with_stop)

    async def main() -> list[Any]:
        engine = AsyncEngine.from_config(EngineConfig(model=str(qwen3_ckpt), engine_process=True, **CFG))
        await engine.start()
        try:
            return await asyncio.gather(
                collect(engine, "a", prompts[0], greedy),
                collect(engine, "b", prompts[1], sampled),
                collect(engine, "c", prompts[0], with_stop),
            )
        finally:
            await engine.shutdown()

    got = asyncio.run(main())
    assert got[0][0] == expected[0].texts and got[0][1] == expected[0].token_ids
    assert got[0][3][0] == pytest.approx([lp.logprob for out in expected[0].outputs[0] for lp in out.logprobs or ()])
    assert got[1][1] == expected[1].token_ids and got[1][2] == ["length", "length"]
    assert got[2][0] == expected_stop.texts and got[2][2] == ["stop"]


@pytest.mark.slow
def test_without_restarts_a_dead_engine_process_fails_in_flight_requests_turns_health_503_and_exits_1(
    qwen3_ckpt: Path,
) -> None:
    with running_server(
        "--model", str(qwen3_ckpt), "--dtype", "float32", "--kv-cache-memory", "8MiB", "--engine-max-restarts", "0"
    ) as server:
        pid = engine_pid(server.log())

        async def scenario() -> tuple[int, list[Any], int | None]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
                body = {"prompt": [5, 6, 7], "max_tokens": 500, "n": 8, "ignore_eos": True, "stream": True}
                events: list[Any] = []
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if (event := sse_event(line)) is not None:
                            if not events:  # the first token is out: the engine is mid-request
                                os.kill(pid, signal.SIGKILL)
                            events.append(event)
                try:
                    health: int | None = (await client.get("/health")).status_code
                except httpx.TransportError:  # the drain ended with the last stream: already gone
                    health = None
                return response.status_code, events, health

        status, events, health = asyncio.run(scenario())
        assert status == 200 and events[-1] == DONE
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and "engine process exited" in errors[0]["message"]
        # NOTE: /health is 503 only while the drain lasts, which ends with this one stream
        # (tests/api/test_robustness_engine.py holds a dead engine's 503 with a slower drain).
        assert health in (503, None)
        assert server.process.wait(30) == 1
        assert (
            "the engine stopped (the engine process exited (exit code -9); restarts are off "
            "(--engine-max-restarts 0)): exiting with status 1"
        ) in server.log()


@pytest.mark.slow
def test_sigterm_stops_the_engine_process_with_the_server(qwen3_ckpt: Path) -> None:
    with running_server("--model", str(qwen3_ckpt), "--dtype", "float32", "--kv-cache-memory", "8MiB") as server:
        pid = engine_pid(server.log())
        assert alive(pid)
        assert server.stop() == 0
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


def test_prompt_logprobs_cross_the_process_boundary_as_ids_and_come_back_as_text(qwen3_ckpt: Path) -> None:
    prompt = list(range(100, 140))
    # A 16-token budget: the prompt's logprobs arrive over three prefill chunks, two with no token.
    cfg = dict(CFG, max_num_batched_tokens=16)
    params = SamplingParams(n=2, max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    [expected] = OfflineEngine.from_config(EngineConfig(model=str(qwen3_ckpt), **cfg)).generate([prompt], params)

    async def main() -> list[Any]:
        engine = AsyncEngine.from_config(EngineConfig(model=str(qwen3_ckpt), engine_process=True, **cfg))
        await engine.start()
        try:
            return [out async for out in engine.generate(prompt, params, "p")]
        finally:
            await engine.shutdown()

    outs = asyncio.run(main())
    for index in (0, 1):
        mine = [out for out in outs if out.index == index]
        assert [out.prompt_logprobs is not None for out in mine] == [True, False, False]  # the first output only
        got, want = mine[0].prompt_logprobs, expected.outputs[index][0].prompt_logprobs
        assert got is not None and want is not None and len(got) == len(prompt) and got[0] is None
        assert [(e.token_id, e.token, [t.token for t in e.top]) for e in got[1:]] == [
            (e.token_id, e.token, [t.token for t in e.top]) for e in want[1:]
        ]
        assert [e.logprob for e in got[1:]] == pytest.approx([e.logprob for e in want[1:]], abs=1e-5)
        assert [e.token_id for e in got[1:]] == prompt[1:] and all(len(e.top) == 2 for e in got[1:])
