"""bench.gpu_smoke's verdicts (the served smoke test of a GPU run): what counts as streaming token by
token, and when two backends' greedy runs may part. The run itself needs two servers; its CPU
rehearsal is `REHEARSE=1 bash scripts/gpu_check.sh smoke`."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from bench.gpu_smoke import StreamResult, check_streams, compare_greedy, one_stream


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeStream:
    """An SSE stream of the OpenAI SDK: `n` one-token content chunks, then the usage chunk; a
    steady stream's chunks are one 5 ms decode step apart on the fake clock, a burst's all at once."""

    def __init__(self, n: int, burst: bool, clock: FakeClock) -> None:
        self.n, self.burst, self.clock = n, burst, clock

    async def __aiter__(self) -> Any:
        for i in range(self.n):
            if not self.burst:
                self.clock.now += 0.005
            yield SimpleNamespace(
                usage=None,
                choices=[
                    SimpleNamespace(
                        delta=SimpleNamespace(content=f"t{i}"), finish_reason="length" if i == self.n - 1 else None
                    )
                ],
            )
        yield SimpleNamespace(usage=SimpleNamespace(completion_tokens=self.n), choices=[])


class FakeClient:
    def __init__(self, burst: bool, clock: FakeClock) -> None:
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))
        self.burst, self.clock = burst, clock

    async def create(self, **kwargs: Any) -> FakeStream:
        self.clock.now += 0.05 if self.burst else 0.01  # a burst: every token generated before the first byte
        return FakeStream(kwargs["max_tokens"], self.burst, self.clock)


def test_a_steady_stream_passes_and_a_burst_at_the_end_fails() -> None:
    clock = FakeClock()
    steady = asyncio.run(one_stream(FakeClient(False, clock), "m", "p", 16, clock))
    burst = asyncio.run(one_stream(FakeClient(True, clock), "m", "p", 16, clock))
    assert steady.content_chunks == burst.content_chunks == 16
    assert check_streams([steady], 16) == []
    [failure] = check_streams([burst], 16)
    assert "burst" in failure and burst.most_chunks_in_1ms > 4


def test_missing_tokens_and_errors_fail() -> None:
    short = StreamResult(completion_tokens=10, content_chunks=10, finish_reason="stop")
    few_chunks = StreamResult(completion_tokens=16, content_chunks=4, finish_reason="length", most_chunks_in_1ms=1)
    broken = StreamResult(error="APIConnectionError: reset")
    failures = check_streams([short, few_chunks, broken], 16)
    assert len(failures) == 3 and "10/16" in failures[0] and "4 content chunks" in failures[1]


def test_greedy_runs_may_part_only_at_a_near_tie() -> None:
    same = [("a", [-0.1, -2.0]), ("b", [-0.2, -3.0])]
    assert compare_greedy("p", same, same, 0.05).verdict == "equal"
    near = [("a", [-0.1, -2.0]), ("x", [-0.70, -0.72])]
    other = [("a", [-0.1, -2.0]), ("y", [-0.70, -0.71])]
    result = compare_greedy("p", near, other, 0.05)
    assert (result.verdict, result.equal_tokens) == ("tie", 1)
    far = [("a", [-0.1, -2.0]), ("x", [-0.1, -2.5])]
    assert compare_greedy("p", far, other, 0.05).verdict == "differ"
    assert compare_greedy("p", same[:1], same, 0.05).verdict == "differ"  # one stopped early
