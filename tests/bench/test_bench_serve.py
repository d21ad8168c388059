"""bench/serve.py against a fake OpenAI-compatible SSE server (Starlette on hypercorn, in a
thread) that streams chunks with known delays: timings, token counts, error kinds, load shapes
and bounds; plus the `serve`, `plot` and `compare` commands end to end."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bench.__main__ import main
from bench.datasets import Conversation, RemoteTokenizer, Turn
from bench.report import load_results
from bench.serve import EndpointError, Load, Target, arrival_times, probe_target, run_load
from bench.stats import CANCELLED, RequestRecord, summarize

TTFT_S, ITL_S = 0.15, 0.05
SLEEP_SLACK = 0.95  # an asyncio.sleep may end a timer tick early


class FakeServer:
    """Streams `max_tokens` chunks " t0", " t1", ... after `ttft_s`, `itl_s` apart (both read
    from the request body). The model name picks a behaviour: "fake" streams normally,
    "fake-500" fails, "fake-error" sends an error event mid-stream, "fake-nousage" omits usage,
    "fake-truncated" ends after two chunks, "fake-reasoning" starts with a reasoning delta,
    "fake-strict" rejects ignore_eos with a 400."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    def reset(self) -> None:
        self.bodies.clear()
        self.peak_in_flight = 0

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        config = Config()
        config.bind = [f"127.0.0.1:{self.port}"]
        config.accesslog = None
        config.errorlog = None
        app = Starlette(
            routes=[
                Route("/v1/models", self._models),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
            ]
        )
        await hypercorn_serve(app, config, shutdown_trigger=self._stop.wait)  # type: ignore[arg-type]

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("fake server did not start")

    def stop(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"count": len(body["prompt"].split()) * 2})

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        model = body["model"]
        if model == "fake-500":
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)
        if model == "fake-strict" and "ignore_eos" in body:
            return JSONResponse({"error": {"message": "unknown field ignore_eos"}}, 400)
        chat = request.url.path.endswith("/chat/completions")
        return StreamingResponse(self._stream(body, model, chat), media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], model: str, chat: bool) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            n = int(body["max_tokens"])
            yield b": keep-alive comment, which clients ignore\n\n"
            await asyncio.sleep(float(body.get("ttft_s", TTFT_S)))
            for i in range(n):
                if i:
                    await asyncio.sleep(float(body.get("itl_s", ITL_S)))
                if model == "fake-error" and i == 2:
                    yield _event({"error": {"message": "engine died", "type": "server_error"}})
                    return
                if model == "fake-truncated" and i == 2:
                    return  # the body ends cleanly, but without finish_reason or [DONE]
                if model == "fake-reasoning" and i == 0:
                    delta = {"reasoning_content": "hmm"}
                else:
                    delta = {"content": f" t{i}"}
                choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
                choice.update({"delta": delta} if chat else {"text": delta.get("content", "")})
                yield _event({"id": "x", "choices": [choice]})
            if model != "fake-nousage":
                yield _event({"id": "x", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": n}})
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    srv.start()
    # One request first, so no timing test pays the server's first-call costs.
    asyncio.run(run_load(Target(srv.base_url, "fake"), Load(concurrency=1, num_requests=1), convs(1, 1)))
    yield srv
    srv.stop()


@pytest.fixture
def fake(server: FakeServer) -> FakeServer:
    server.reset()
    return server


def convs(n: int, max_tokens: int = 5, turns: int = 1) -> list[Conversation]:
    return [Conversation(i, tuple(Turn(f"question {i}.{t}", 3, max_tokens) for t in range(turns))) for i in range(n)]


def target(fake: FakeServer, model: str = "fake", **kw: object) -> Target:
    return Target(fake.base_url, model, **kw)  # type: ignore[arg-type]


def run(t: Target, load: Load, conversations: list[Conversation]) -> tuple[RequestRecord, ...]:
    return asyncio.run(run_load(t, load, conversations)).records


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_ttft_itl_and_e2e_match_the_server_delays(fake: FakeServer, endpoint: str) -> None:
    records = run(target(fake, endpoint=endpoint), Load(concurrency=2, num_requests=4), convs(4, max_tokens=6))
    assert [r.index for r in records] == [0, 1, 2, 3]
    # NOTE: the server's delays are lower bounds of what the client measures (a loaded machine only
    # adds to them), and the measures must agree with each other.
    for r in records:
        assert r.ok, r.error_message
        assert r.ttft >= SLEEP_SLACK * TTFT_S
        assert len(r.itls) == 5 and all(gap > 0 for gap in r.itls)
        assert r.e2e >= max(SLEEP_SLACK * (TTFT_S + 5 * ITL_S), r.ttft + sum(r.itls))  # e2e also waits for the end
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / 5)
        assert (r.prompt_tokens, r.output_tokens, r.usage_counted) == (11, 6, False)


def test_request_asks_for_exact_length_and_usage(fake: FakeServer) -> None:
    run(target(fake, extra_body={"top_k": 3}), Load(concurrency=1, num_requests=1), convs(1, max_tokens=4))
    (body,) = fake.bodies
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"]) == (4, 4, True)
    assert body["messages"] == [{"role": "user", "content": "question 0.0"}]
    assert (body["temperature"], body["top_k"]) == (0.0, 3)


def test_reasoning_delta_counts_for_ttft_but_not_for_the_answer(fake: FakeServer) -> None:
    records = run(target(fake, "fake-reasoning"), Load(concurrency=1, num_requests=2), convs(1, max_tokens=3, turns=2))
    assert all(r.ok and r.ttft >= SLEEP_SLACK * TTFT_S for r in records)
    # The second turn carries the first answer: content only, the reasoning left out.
    assert fake.bodies[1]["messages"][1] == {"role": "assistant", "content": " t1 t2"}


def test_multi_turn_sends_each_answer_with_the_next_turn(fake: FakeServer) -> None:
    records = run(target(fake), Load(concurrency=1, num_requests=3), convs(2, 2, turns=2))
    assert [(r.conversation_id, r.turn) for r in records] == [(0, 0), (0, 1), (1, 0)]
    assert [len(b["messages"]) for b in fake.bodies] == [1, 3, 1]
    assert fake.bodies[1]["messages"][1:] == [
        {"role": "assistant", "content": " t0 t1"},
        {"role": "user", "content": "question 0.1"},
    ]


@pytest.mark.parametrize(
    ("model", "kind"),
    [
        ("fake-500", "http_500"),
        ("fake-error", "stream_error"),
        ("fake-truncated", "truncated_stream"),
    ],
)
def test_failures_are_counted_by_kind(fake: FakeServer, model: str, kind: str) -> None:
    records = run(target(fake, model), Load(concurrency=2, num_requests=3), convs(3, 4))
    assert [r.error for r in records] == [kind] * 3
    s = summarize(records, 1.0)
    assert (s["completed"], s["failed"], s["errors"]) == (0, 3, {kind: 3})
    if kind == "http_500":
        assert "boom" in (records[0].error_message or "")
    if kind == "stream_error":
        assert records[0].error_message == "engine died"


def test_unreachable_server_is_an_exception_kind(fake: FakeServer) -> None:
    t = Target(f"http://127.0.0.1:{_free_port()}/v1", "fake")
    (r,) = run(t, Load(concurrency=1, num_requests=1), convs(1))
    assert r.error == "ConnectError" and r.e2e is None


def test_missing_usage_falls_back_to_counting_chunks_and_says_so(fake: FakeServer) -> None:
    (r,) = run(target(fake, "fake-nousage"), Load(concurrency=1, num_requests=1), convs(1, 7))
    assert r.ok and (r.output_tokens, r.prompt_tokens, r.usage_counted) == (7, None, True)
    assert summarize([r], 1.0)["usage_counted"] == 1


@pytest.mark.parametrize("concurrency", [1, 3])
def test_closed_loop_keeps_exactly_concurrency_in_flight(fake: FakeServer, concurrency: int) -> None:
    records = run(
        target(fake, extra_body={"ttft_s": 0.05, "itl_s": 0.02}),
        Load(concurrency=concurrency, num_requests=3 * concurrency),
        convs(5 * concurrency, 4),
    )
    assert len(records) == 3 * concurrency and all(r.ok for r in records)
    assert fake.peak_in_flight == concurrency


def test_duration_bound_cancels_what_is_in_flight(fake: FakeServer) -> None:
    # Each request would take 4 s (20 tokens 0.2 s apart): cancelled ones prove the bound cut them.
    result = asyncio.run(
        run_load(
            target(fake, extra_body={"itl_s": 0.2}), Load(concurrency=2, num_requests=50, duration_s=0.6), convs(50, 20)
        )
    )
    assert result.timed_out and not result.interrupted
    assert [r.error for r in result.records] == [CANCELLED, CANCELLED]
    assert summarize(result.records, result.duration_s)["cancelled"] == 2


def test_stop_event_ends_the_run_with_what_was_measured(fake: FakeServer) -> None:
    async def go() -> object:
        stop = asyncio.Event()

        async def stop_after_three() -> None:  # the fake server has had three requests
            while len(fake.bodies) < 3:
                await asyncio.sleep(0.01)
            stop.set()

        stopper = asyncio.create_task(stop_after_three())
        result = await run_load(
            target(fake, extra_body={"ttft_s": 0.05, "itl_s": 0.02}),
            Load(concurrency=1, num_requests=100),
            convs(100, 3),
            stop=stop,
        )
        stopper.cancel()
        return result

    result = asyncio.run(go())
    assert result.interrupted and not result.timed_out  # type: ignore[attr-defined]
    records = result.records  # type: ignore[attr-defined]
    assert 3 <= len(records) < 100
    assert all(r.ok for r in records[:-1]) and records[-1].error in (None, CANCELLED)


def test_open_loop_sends_at_the_seeded_arrival_times(fake: FakeServer) -> None:
    load = Load(request_rate=20.0, num_requests=8, seed=5)
    records = run(target(fake, extra_body={"ttft_s": 0.01, "itl_s": 0.01}), load, convs(8, 2))
    expected = arrival_times(20.0, 8, seed=5)
    # Never before its arrival time (a loaded machine may send later, not sooner).
    assert all(sent >= planned - 0.01 for sent, planned in zip([r.send_time for r in records], expected))
    assert [r.send_time for r in records] == sorted(r.send_time for r in records)


def test_open_loop_cap_limits_requests_in_flight(fake: FakeServer) -> None:
    load = Load(request_rate=float("inf"), max_concurrency=2, num_requests=6)
    records = run(target(fake, extra_body={"ttft_s": 0.05, "itl_s": 0.01}), load, convs(6, 2))
    assert all(r.ok for r in records) and fake.peak_in_flight == 2


def test_probe_drops_extensions_the_server_rejects(fake: FakeServer) -> None:
    adjusted, note = asyncio.run(probe_target(target(fake, "fake-strict")))
    assert adjusted.ignore_eos is False and note and "ignore_eos" in note
    same, none = asyncio.run(probe_target(target(fake)))
    assert same.ignore_eos is True and none is None


def test_probe_fails_early_with_the_server_message(fake: FakeServer) -> None:
    with pytest.raises(EndpointError, match="http_500.*boom"):
        asyncio.run(probe_target(target(fake, "fake-500")))


def test_remote_tokenizer_counts_through_the_tokenize_route(fake: FakeServer) -> None:
    tok = RemoteTokenizer.probe(fake.base_url, "fake", None)
    assert tok is not None and tok.exact
    assert tok.count("a b c") == 6


def test_serve_plot_compare_commands_end_to_end(
    fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep.json"
    code = main(
        [
            "serve",
            "--base-url",
            fake.base_url,
            "--concurrency",
            "1,2",
            "--num-requests",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--extra-body",
            '{"ttft_s": 0.02, "itl_s": 0.01}',
            "--slo",
            "ttft=1000",
            "--no-progress",
            "--label",
            "fakeserve",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "c=1" in printed and "c=2" in printed and "TTFT" in printed
    results = load_results(out)
    assert [r["config"]["load_label"] for r in results] == ["c=1", "c=2"]
    for r in results:
        s = r["summary"]
        assert (s["completed"], s["failed"], s["total_output_tokens"]) == (3, 0, 9)
        assert s["goodput"] == pytest.approx(s["request_throughput"])
        assert {"ttft_ms.p99", "itl_ms.p50", "tpot_ms.p50", "e2e_ms.mean"} <= set(s)
        assert r["config"]["model"] == "fake" and r["config"]["tokenizer"].startswith("server:")
        assert all(q["ttft_ms"] <= q["e2e_ms"] for q in r["requests"])
    assert main(["plot", str(out), str(out), "--out", str(tmp_path / "png")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert pngs == ["latency_cdf.png", "latency_vs_throughput.png", "throughput_vs_load.png"]
    assert all((tmp_path / "png" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    capsys.readouterr()
    assert main(["compare", str(out), str(out)]) == 0
    table = capsys.readouterr().out
    assert "c=2" in table and "output throughput (tok/s)" in table and "1.00x" in table
