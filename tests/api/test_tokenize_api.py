"""POST /tokenize and /detokenize (vLLM's shapes, at the root) on a real server with an API key
(in this process, under hypercorn on 127.0.0.1): a prompt's ids are the checkpoint tokenizer's and
decode back to the same text; chat messages count exactly what the chat endpoint bills as
usage.prompt_tokens; both routes sit behind the key like /v1/*; mistakes are OpenAI-style 400s."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from api.app import ServerConfig
from engine.config import EngineConfig
from engine.front.tokenizer import Tokenizer
from engine.weights.demo_model import DEMO_MODEL_NAME, ensure_demo_model
from tests.server_utils import HTTP, InProcessServer, in_process_server

ENGINE = EngineConfig(kv_cache_memory="16MiB", max_model_len=1024)
KEY = "sk-tokenize-test"
VOCAB = 151_669  # the demo tokenizer's, added tokens included
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHATS = {
    "one-user-turn": {"messages": [{"role": "user", "content": "Hello there!"}]},
    "system-and-turns": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Weather?"},
        ]
    },
    "thinking-off": {
        "messages": [{"role": "user", "content": "2+2?"}],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "with-tools": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]},
}
TEXTS = ["hello world", "  leading spaces and ünïcödé 🙂\n\ttabs", "<|im_start|>user\nhi<|im_end|>", "数字 12345"]


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with in_process_server(ServerConfig(engine=ENGINE, api_key=KEY)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: InProcessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The checkpoint's tokenizer, loaded here independently of the server."""
    return Tokenizer(ensure_demo_model())


def post_ok(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("text", TEXTS)
def test_a_prompt_tokenizes_as_the_checkpoint_and_decodes_back(
    http: httpx.Client, tokenizer: Tokenizer, text: str
) -> None:
    tokenized = post_ok(http, "/tokenize", {"model": DEMO_MODEL_NAME, "prompt": text})
    assert tokenized["tokens"] == tokenizer.encode(text)
    assert tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == ENGINE.max_model_len
    assert post_ok(http, "/detokenize", {"model": DEMO_MODEL_NAME, "tokens": tokenized["tokens"]}) == {"prompt": text}


def test_token_strs_are_the_vocabulary_pieces(http: httpx.Client, tokenizer: Tokenizer) -> None:
    tokenized = post_ok(http, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert tokenized["token_strs"] == ["hello", "Ġworld"]
    assert tokenized["tokens"] == [tokenizer.backend.token_to_id(p) for p in tokenized["token_strs"]]
    assert "token_strs" not in post_ok(http, "/tokenize", {"prompt": "hello world"})


@pytest.mark.parametrize("chat", CHATS.values(), ids=CHATS.keys())
def test_messages_count_what_the_chat_endpoint_bills(
    http: httpx.Client, server: InProcessServer, chat: dict[str, Any]
) -> None:
    tokenized = post_ok(http, "/tokenize", chat)
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=60)
    extra = {k: v for k, v in chat.items() if k not in ("messages", "tools")}
    completion = client.chat.completions.create(
        model=DEMO_MODEL_NAME,
        messages=chat["messages"],
        tools=chat.get("tools", openai.omit),
        max_tokens=1,
        temperature=0,
        extra_body={**extra, "return_token_ids": True},
    )
    assert completion.usage.prompt_tokens == tokenized["count"]
    assert completion.model_extra["prompt_token_ids"] == tokenized["tokens"]


def test_messages_render_through_the_chat_template(http: httpx.Client, tokenizer: Tokenizer) -> None:
    messages = CHATS["system-and-turns"]["messages"]
    tokenized = post_ok(http, "/tokenize", {"messages": messages})
    text = post_ok(http, "/detokenize", {"tokens": tokenized["tokens"]})["prompt"]
    assert text == tokenizer.render_chat(messages)
    assert text.endswith("<|im_start|>assistant\n")


def test_without_the_generation_prompt_the_assistant_header_is_left_out(
    http: httpx.Client, tokenizer: Tokenizer
) -> None:
    messages = CHATS["one-user-turn"]["messages"]
    with_prompt = post_ok(http, "/tokenize", {"messages": messages})["tokens"]
    without = post_ok(http, "/tokenize", {"messages": messages, "add_generation_prompt": False})["tokens"]
    assert with_prompt == without + tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)


def test_an_empty_prompt_and_no_tokens_are_empty(http: httpx.Client) -> None:
    empty = {"tokens": [], "count": 0, "max_model_len": ENGINE.max_model_len}
    assert post_ok(http, "/tokenize", {"prompt": ""}) == empty
    assert post_ok(http, "/detokenize", {"tokens": []}) == {"prompt": ""}


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "missing API key: send 'Authorization: Bearer <key>'"),
        ({"Authorization": "Bearer sk-wrong"}, "invalid API key"),
        ({"Authorization": f"Basic {KEY}"}, "invalid API key"),
    ],
)
def test_the_routes_need_the_api_key(server: InProcessServer, path: str, headers: dict[str, str], message: str) -> None:
    body = {"prompt": "hi"} if path == "/tokenize" else {"tokens": [1]}
    response = HTTP.post(server.url(path), json=body, headers=headers, timeout=30)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json() == {
        "error": {"message": message, "type": "authentication_error", "param": None, "code": "invalid_api_key"}
    }


BAD_REQUESTS = {
    "neither": ("/tokenize", {"model": DEMO_MODEL_NAME}, 400, "messages"),
    "both": ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    "prompt-not-text": ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    "bad-message": ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    "bad-template-kwargs": (
        "/tokenize",
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
        400,
        "chat_template_kwargs",
    ),
    "unknown-model": ("/tokenize", {"model": "gpt-4o", "prompt": "x"}, 404, "model"),
    "tokens-missing": ("/detokenize", {}, 400, "tokens"),
    "tokens-not-ids": ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    "token-outside-vocab": ("/detokenize", {"tokens": [1, VOCAB]}, 400, "tokens"),
    "negative-token": ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
}


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_mistakes_are_openai_style_errors_naming_the_param(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_a_body_that_is_not_json_is_a_400(http: httpx.Client) -> None:
    response = http.post("/tokenize", content=b"prompt=hi", headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_get_is_not_allowed(http: httpx.Client) -> None:
    assert http.get("/tokenize").status_code == 405
