"""/v1/messages as Claude Code meets it (issue 26), through a real server (hypercorn on 127.0.0.1, in
this process) and the official `anthropic` SDK: a system message inside `messages`, max_tokens 32000
against a small context (clamped, or refused in the words Claude Code parses), a prompt too long in
the words of its compaction trigger, usage as Anthropic defines it (cached tokens apart, in
message_start too), thinking off when absent, and a forced tool call that the random demo model
completes within 200 tokens. Claude Code's own patterns (from its cli.js) are the assertions'
regular expressions. Scripted answers come from tests/api/test_tools_e2e.py's ScriptedCore."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from engine.core import EngineCore
from engine.weights.demo_model import DEMO_MODEL_NAME
from tests.api.test_tools_e2e import ENGINE, ScriptedCore, scripted_server
from tests.server_utils import InProcessServer

# Claude Code 2.1.197's patterns (from its binary): its max_tokens retry, its compaction trigger.
OVERFLOW = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)")
TOO_LONG = re.compile(r"^prompt is too long: (\d+) tokens > (\d+) maximum$")


def claude_code_falls_back_from_system(message: str) -> bool:
    """Claude Code 2.1.197's test for a refused mid-conversation system message (after which it
    resends the conversation without them); the third case is the beta header named in the error."""
    return ("Unexpected role" in message and "input message role" in message) or (
        "not supported" in message and re.search(r"role .{0,2}system", message, re.IGNORECASE) is not None
    )


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MODE = {
    "name": "set_mode",
    "input_schema": {
        "type": "object",
        "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}, "level": {"type": "integer"}},
        "required": ["mode", "level"],
    },
}
LONG_REPLY = "It will be sunny in Paris. " * 40


@pytest.fixture(scope="module")
def scripted() -> ScriptedCore:
    return ScriptedCore(EngineCore(ENGINE))


@pytest.fixture(scope="module")
def server(scripted: ScriptedCore) -> Iterator[InProcessServer]:
    with scripted_server(scripted, "auto", "auto") as running:
        yield running


@pytest.fixture
def client(server: InProcessServer, scripted: ScriptedCore) -> Iterator[anthropic.Anthropic]:
    scripted.clear()
    yield anthropic.Anthropic(base_url=server.url(""), api_key="unused", max_retries=0, timeout=120)
    scripted.clear()


def create(client: anthropic.Anthropic, **kwargs: Any) -> Any:
    return client.messages.create(**{"model": DEMO_MODEL_NAME, "max_tokens": 300, "messages": MESSAGES, **kwargs})


def count(client: anthropic.Anthropic, **kwargs: Any) -> int:
    return client.messages.count_tokens(**{"model": DEMO_MODEL_NAME, "messages": MESSAGES, **kwargs}).input_tokens


def long_messages(words: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Summarise this:" + " cat" * words}]


def max_model_len(server: InProcessServer) -> int:
    return server.engine.info.max_model_len


# ---- system messages inside `messages` -------------------------------------------------------------
def test_a_system_message_inside_messages_is_accepted_where_claude_code_puts_it(
    scripted: ScriptedCore, client: anthropic.Anthropic
) -> None:
    environment = {
        "role": "system",
        "content": [
            {
                "type": "text",
                "text": "# Environment\nPrimary working directory: /w",
                "cache_control": {"type": "ephemeral"},
            }
        ],
    }
    conversation = [MESSAGES[0], environment, {"role": "user", "content": "And tomorrow?"}]
    scripted.expect("Sunny.")
    message = create(client, messages=conversation)
    assert message.content[0].text == "Sunny." and message.stop_reason == "end_turn"
    without = [MESSAGES[0], {"role": "user", "content": "And tomorrow?"}]
    assert count(client, messages=conversation) > count(client, messages=without)  # the text reached the prompt


def test_a_system_message_with_other_content_is_refused_in_words_claude_code_recovers_from(
    client: anthropic.Anthropic,
) -> None:
    tools_change = {"role": "system", "content": [{"type": "tool_addition", "tool": {"name": "x"}}]}
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(client, messages=[MESSAGES[0], tools_change])
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert claude_code_falls_back_from_system(refused.value.body["error"]["message"])


# ---- max_tokens against the context ---------------------------------------------------------------
def test_max_tokens_32000_is_clamped_to_the_room_left_and_stops_with_max_tokens(
    server: InProcessServer, scripted: ScriptedCore, client: anthropic.Anthropic
) -> None:
    messages = long_messages(1930)
    num_prompt = count(client, messages=messages)
    room = max_model_len(server) - num_prompt
    assert 0 < room < 200
    scripted.expect(LONG_REPLY)
    message = create(client, messages=messages, max_tokens=32000)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == room


def test_with_the_reject_policy_the_overflow_is_worded_for_claude_codes_retry(
    server: InProcessServer, client: anthropic.Anthropic
) -> None:
    messages = long_messages(1930)
    num_prompt = count(client, messages=messages)
    server.engine.input_processor.max_tokens_policy = "reject"  # what --max-tokens-policy reject sets
    try:
        with pytest.raises(anthropic.BadRequestError) as refused:
            create(client, messages=messages, max_tokens=32000)
    finally:
        server.engine.input_processor.max_tokens_policy = "clamp"
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error"
    match = OVERFLOW.search(error["message"])
    assert match and tuple(map(int, match.groups())) == (num_prompt, 32000, max_model_len(server))
    assert error["message"].endswith("decrease input length or `max_tokens` and try again")


@pytest.mark.parametrize("words", [4000, 600_000])  # tokenized, and refused from its length before that
def test_a_prompt_too_long_alone_is_worded_for_claude_codes_compaction(
    server: InProcessServer, client: anthropic.Anthropic, words: int
) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(client, messages=long_messages(words))
    match = TOO_LONG.match(refused.value.body["error"]["message"])
    assert match is not None, refused.value.body
    assert int(match[2]) == max_model_len(server) - 1 and int(match[1]) > int(match[2])
    if words > 100_000:  # count_tokens refuses it the same way, before tokenizing it
        with pytest.raises(anthropic.BadRequestError) as counted:
            count(client, messages=long_messages(words))
        assert TOO_LONG.match(counted.value.body["error"]["message"])


# ---- usage -----------------------------------------------------------------------------------------
def test_usage_counts_cached_tokens_once_in_message_start_delta_and_body(
    scripted: ScriptedCore, client: anthropic.Anthropic
) -> None:
    messages = long_messages(800)
    num_prompt = count(client, messages=messages)
    scripted.expect("Done.")
    first = create(client, messages=messages)
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == num_prompt
    scripted.expect("Done.")
    with client.messages.stream(model=DEMO_MODEL_NAME, max_tokens=50, messages=messages) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = events[0].message.usage
    assert start.cache_read_input_tokens > num_prompt // 2  # the repeated prompt came from the prefix cache
    assert start.input_tokens + start.cache_read_input_tokens + start.cache_creation_input_tokens == num_prompt
    [delta] = [e.usage for e in events if e.type == "message_delta"]  # Anthropic's: cumulative, cache fields too
    assert (delta.input_tokens, delta.cache_read_input_tokens, delta.cache_creation_input_tokens) == (
        start.input_tokens,
        start.cache_read_input_tokens,
        start.cache_creation_input_tokens,
    )
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (
        start.input_tokens,
        start.cache_read_input_tokens,
    )
    assert final.usage.output_tokens == 3  # "Done." and the end token


# ---- thinking and forced calls ---------------------------------------------------------------------
def test_absent_thinking_means_off_as_in_anthropics_api(client: anthropic.Anthropic) -> None:
    off = count(client, thinking={"type": "disabled"})
    assert count(client) == off != count(client, thinking={"type": "enabled", "budget_tokens": 1024})


@pytest.mark.parametrize("seed", [1, 2])
def test_a_forced_call_on_the_random_model_completes_within_200_tokens(client: anthropic.Anthropic, seed: int) -> None:
    message = create(
        client,
        max_tokens=200,
        tools=[MODE],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"seed": seed},
    )
    assert message.stop_reason == "tool_use", message
    [block] = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "set_mode" and block.input["mode"] in ("fast", "slow")
