"""The OpenAI surface as users meet it: a real hypercorn server with the demo model, driven
by the official `openai` client (and raw HTTP where the SDK hides the wire)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_utils import HTTP, RunningServer, start_server

pytestmark = pytest.mark.slow  # real servers in subprocesses: `make test-fast` skips them

MODEL = "fp4serve-demo-qwen3"
MAX_MODEL_LEN = 128
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    s = start_server("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "32MiB")
    try:
        yield s
    finally:
        assert s.stop() == 0, "SIGTERM should end the server cleanly"


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[Any]:
    with server.openai(timeout=60) as c:
        yield c


def stream_chat(client: Any, **kwargs: Any) -> list[Any]:
    return list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))


def content_of(chunks: list[Any], index: int = 0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


def test_greedy_stream_and_non_stream_give_the_same_text(client: Any) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    chunks = stream_chat(client, messages=HELLO, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content
    assert content_of(chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12


def test_64_token_stream_arrives_token_by_token(client: Any) -> None:
    start = time.perf_counter()
    arrivals: list[tuple[float, Any]] = []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=64, stream=True, temperature=0, extra_body={"ignore_eos": True}
    ):
        arrivals.append((time.perf_counter(), chunk))
    chunks = [c for _, c in arrivals]
    assert chunks[0].choices[0].delta.role == "assistant"
    content_times = [t for t, c in arrivals if c.choices and c.choices[0].delta.content]
    assert len(content_times) >= 60
    assert {c.id for c in chunks} == {chunks[0].id} and {c.created for c in chunks} == {chunks[0].created}
    finishes = [c.choices[0].finish_reason for c in chunks]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    # Buffered output would arrive in one burst at the end; per-token output is spread out.
    total = arrivals[-1][0] - start
    assert arrivals[-1][0] - content_times[0] > 0.5 * total, (content_times[0] - start, total)


def test_n3_with_a_seed_is_reproducible_streaming_or_not(client: Any) -> None:
    kwargs: dict[str, Any] = {"messages": HELLO, "max_tokens": 8, "n": 3, "seed": 1234, "temperature": 1.0}
    first = client.chat.completions.create(model=MODEL, **kwargs)
    second = client.chat.completions.create(model=MODEL, **kwargs)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in sorted(second.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, "each of the n samples gets its own seed"
    chunks = stream_chat(client, **kwargs)
    assert [content_of(chunks, i) for i in range(3)] == texts


def test_stop_string_spanning_two_tokens_is_cut_exactly(client: Any) -> None:
    sampling: dict[str, Any] = {"max_tokens": 24, "seed": 7, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    chunks = stream_chat(
        client, messages=HELLO, **{**sampling, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    )
    steps = [(c.choices[0].delta.content or "", c.choices[0].model_extra["token_ids"]) for c in chunks[1:] if c.choices]
    full = "".join(text for text, _ in steps)
    for i in range(len(steps) - 1):
        (left, left_ids), (right, right_ids) = steps[i], steps[i + 1]
        if len(left_ids) == 1 and len(right_ids) == 1 and left and right:
            prefix = "".join(text for text, _ in steps[:i]) + left[:-1]
            stop = left[-1] + right[0]
            if full.find(stop) == len(prefix):
                break
    else:
        pytest.fail(f"no two single-token steps to put a stop string across: {steps}")
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, stop=[stop], **sampling)
    assert whole.choices[0].message.content == prefix
    assert whole.choices[0].finish_reason == "stop"
    assert content_of(stream_chat(client, messages=HELLO, stop=stop, **sampling)) == prefix


def test_include_usage_sends_a_last_chunk_with_no_choices(client: Any) -> None:
    chunks = stream_chat(
        client, messages=HELLO, max_tokens=5, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        whole.usage.prompt_tokens,
        5,
        whole.usage.prompt_tokens + 5,
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs_streaming_and_not(client: Any) -> None:
    kwargs: dict[str, Any] = {"messages": HELLO, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    whole = client.chat.completions.create(model=MODEL, **kwargs)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == 5
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and tops[0] <= 0.0
        # Greedy picks the most likely token, so it is the first alternative.
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    streamed = [
        e
        for c in stream_chat(client, **kwargs)[1:]
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_return_token_ids_and_a_token_id_prompt_for_completions(client: Any) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    prompt_ids, token_ids = whole.model_extra["prompt_token_ids"], whole.choices[0].model_extra["token_ids"]
    assert len(prompt_ids) == whole.usage.prompt_tokens and len(token_ids) == 6
    chunks = stream_chat(client, messages=HELLO, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks[1:] if c.choices for t in c.choices[0].model_extra["token_ids"]] == token_ids
    # The chat's own prompt ids sent to /v1/completions continue exactly as the chat did.
    completion = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    assert completion.choices[0].text == whole.choices[0].message.content
    assert completion.choices[0].model_extra["token_ids"] == token_ids
    assert completion.choices[0].model_extra["prompt_token_ids"] == prompt_ids


def test_completions_take_several_prompts_each_with_its_own_choices(client: Any) -> None:
    single = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    several = client.completions.create(model=MODEL, prompt=["Once upon", [5, 6, 7]], n=2, max_tokens=4, temperature=0)
    by_index = {c.index: c.text for c in several.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[2] == by_index[3] == single.choices[0].text
    assert several.usage.prompt_tokens == single.usage.prompt_tokens + 2  # "Once upon" is 2 tokens
    assert several.usage.completion_tokens == 16
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model=MODEL, prompt=["Once upon", [5, 6, 7]], n=2, max_tokens=4, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == by_index


def test_completion_logprobs_have_offsets_into_the_text(client: Any) -> None:
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(len(top) <= 2 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))


def test_absent_max_tokens_generates_to_the_end_of_the_context(client: Any) -> None:
    prompt = list(range(100, 200))
    out = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == MAX_MODEL_LEN - len(prompt)
    assert out.choices[0].finish_reason == "length"


def cpu_attention_backend() -> str:
    """What `--attention-backend auto` picks on this CPU: the paged-attention ops compiled on the
    machine where they build (the server has built them by now), else the torch reference."""
    from engine.host.cpu_kernels import load_cpu_ops

    return "torch" if load_cpu_ops() else "cpu"


def test_models_health_and_version(server: RunningServer, client: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["fp4serve-demo-qwen3"]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    health = HTTP.get(server.url("/health")).json()
    assert health["status"] == "ok" and health["model"] == "fp4serve-demo-qwen3"
    assert (health["device"], health["attention_backend"]) == ("cpu", cpu_attention_backend())
    assert HTTP.get(server.url("/version")).json()["version"] == "0.1.0"


def test_sse_wire_format(server: RunningServer) -> None:
    body = {"messages": HELLO, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url("/v1/chat/completions"), json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2])


def test_startup_log_names_model_device_backend_capacity_and_url(server: RunningServer) -> None:
    line = next(line for line in server.log().splitlines() if " ready: " in line)
    for part in (
        "fp4serve-demo-qwen3",
        "dtype",
        "device cpu",
        f"attention {cpu_attention_backend()}",
        "KV cache",
        "tokens",
        server.base_url,
    ):
        assert part in line
