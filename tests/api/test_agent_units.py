"""The pieces behind the agent-facing front (issues 26 and 32), without a server: the characters one
token can cover (and that the bound never refuses a prompt that fits), folding system messages,
the template probe, generation_config.json defaults, Codex's namespace tools, each API's
context-length words, Anthropic's mapping and usage, the depth check, a refusal's metric reason,
and the flags."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from api.access.request_log import rejection_reason
from api.anthropic.request import MessagesRequestModel
from api.anthropic.routes import usage
from api.cli import build_parser, server_config
from api.context_errors import CHAT, COMPLETIONS, MESSAGES, RESPONSES, context_length_error
from api.errors import APIError, ErrorBody
from api.request.validation import check_depth, validate
from api.responses.tools import ResponsesTools
from engine.errors import ConfigError, ContextLengthError
from engine.front.chat_messages import TemplateTraits, fold_system_messages
from engine.front.prompt_bound import chars_per_token_bound
from engine.front.tokenizer import Tokenizer
from engine.weights.config.generation_config import generation_defaults
from engine.weights.demo_model import ensure_demo_model
from scheduler.request import ParamError
from tests.factories import write_word_tokenizer

U, S = "user", "system"


# ---- the prompt bound ------------------------------------------------------------------------------
ADVERSARIAL = [
    " " * 5000,  # Qwen's longest token: 128 spaces
    "//" + "-" * 5000,
    unicodedata.normalize("NFD", "\u1f82") * 2000,  # 4 code points NFC composes into one
    "\u1100\u1161\u11a8" * 2000,  # Hangul jamo: 3 into one syllable
    "漢字仮名交じり文" * 500,
    "🙂👍🏽" * 800,
    "<|im_start|>" * 400,
    "the cat sat on the mat. " * 400,
]


def test_the_bound_is_four_times_qwens_longest_token_and_none_for_a_word_tokenizer(tmp_path: Path) -> None:
    assert chars_per_token_bound(Tokenizer(ensure_demo_model()).backend) == 4 * 128
    write_word_tokenizer(tmp_path, 64)
    assert chars_per_token_bound(Tokenizer(tmp_path).backend) is None  # an unknown word is one token, any length


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_no_text_has_fewer_tokens_than_the_bound_says(text: str) -> None:
    tokenizer = Tokenizer(ensure_demo_model())
    bound = chars_per_token_bound(tokenizer.backend)
    assert bound is not None and len(tokenizer.encode(text, add_special_tokens=False)) >= len(text) / bound


# ---- templates and system messages -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("messages", "folded"),
    [
        ([{"role": U, "content": "a"}], [{"role": U, "content": "a"}]),
        (
            [{"role": S, "content": "s"}, {"role": U, "content": "a"}],
            [{"role": S, "content": "s"}, {"role": U, "content": "a"}],
        ),
        (
            [
                {"role": S, "content": "s"},
                {"role": U, "content": "a"},
                {"role": S, "content": "t"},
                {"role": U, "content": "b"},
            ],
            [{"role": S, "content": "s\n\nt"}, {"role": U, "content": "a"}, {"role": U, "content": "b"}],
        ),
        (
            [{"role": U, "content": "a"}, {"role": S, "content": "t"}, {"role": S, "content": "u"}],
            [{"role": S, "content": "t\n\nu"}, {"role": U, "content": "a"}],
        ),
    ],
)
def test_system_messages_after_the_first_fold_into_the_system_prompt_in_order(
    messages: list[Any], folded: list[Any]
) -> None:
    assert fold_system_messages(messages) == folded


def test_the_probe_tells_a_template_that_refuses_a_late_system_message_and_ignores_tools() -> None:
    def strict(messages: list[dict[str, Any]], tools: Any) -> str:
        if any(m["role"] == S for m in messages[1:]):
            raise ParamError("the chat template failed on these messages: System message must be at the beginning.")
        return "".join(m["content"] for m in messages)

    assert TemplateTraits.probe(strict) == TemplateTraits(renders_tools=False, renders_mid_system=False)
    demo = Tokenizer(ensure_demo_model())
    assert TemplateTraits.probe(demo.render_chat) == TemplateTraits(renders_tools=True, renders_mid_system=True)


# ---- generation_config.json -------------------------------------------------------------------------
def test_generation_defaults_auto_vllm_and_a_folder(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.7,
                "top_k": 20,
                "top_p": 0.8,
                "repetition_penalty": 1.05,
                "do_sample": True,
                "eos_token_id": 2,
            }
        )
    )
    with caplog.at_level("INFO", logger="fp4serve.engine"):
        assert generation_defaults("auto", tmp_path / "m") == (
            ("temperature", 0.7),
            ("top_p", 0.8),
            ("top_k", 20),
            ("repetition_penalty", 1.05),
        )
        assert generation_defaults("vllm", tmp_path / "m") == ()
    applied, off = [r.getMessage() for r in caplog.records]
    assert applied.startswith("generation config: temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05 from ")
    assert off.startswith("generation config: none applied (--generation-config vllm)")
    assert generation_defaults("auto", tmp_path) == ()  # no file: OpenAI's defaults
    assert generation_defaults(str(tmp_path / "m"), tmp_path) == generation_defaults("auto", tmp_path / "m")
    with pytest.raises(ConfigError, match="does not exist"):
        generation_defaults(str(tmp_path), tmp_path / "m")


@pytest.mark.parametrize(
    "bad", [{"temperature": -1}, {"top_p": 0}, {"top_k": 2.5}, {"min_p": 2}, {"temperature": "hot"}]
)
def test_a_generation_config_value_no_request_could_send_fails_start_up(tmp_path: Path, bad: dict[str, Any]) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=next(iter(bad))):
        generation_defaults("auto", tmp_path)


def test_a_request_value_wins_over_a_default() -> None:
    from api.request.models import ChatCompletionRequest

    defaults = (("temperature", 0.6), ("top_k", 20))
    chat = validate(ChatCompletionRequest, {"messages": [{"role": U, "content": "a"}], "temperature": 1.0})
    params = chat.to_sampling_params(defaults)
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 20, 1.0)


# ---- Codex's namespace tools ------------------------------------------------------------------------
def ns(name: str, *functions: str) -> dict[str, Any]:
    return {"type": "namespace", "name": name, "tools": [{"type": "function", "name": f} for f in functions]}


def test_namespaces_flatten_under_their_own_names_unless_another_tool_has_it() -> None:
    tools = ResponsesTools.parse(
        [
            {"type": "function", "name": "close_agent"},
            ns("agents", "spawn_agent", "close_agent"),
            ns("other", "spawn_agent"),
            {"type": "web_search"},
            {"type": "custom", "name": "x"},
        ]
    )
    assert [t["function"]["name"] for t in tools.tools or []] == [
        "close_agent",
        "agents__spawn_agent",
        "agents__close_agent",
        "other__spawn_agent",
    ]
    assert tools.wire_name("agents__close_agent") == ("close_agent", "agents")
    assert tools.wire_name("close_agent") == ("close_agent", None)
    assert tools.visible_name("spawn_agent", "other") == "other__spawn_agent"
    assert tools.dropped == ("web_search", "custom")
    alone = ResponsesTools.parse([ns("multi_agent_v1", "spawn_agent")])
    assert alone.wire_name("spawn_agent") == ("spawn_agent", "multi_agent_v1")
    assert alone.tool_choice({"type": "function", "name": "spawn_agent"}) == {
        "type": "function",
        "function": {"name": "spawn_agent"},
    }
    assert tools.tool_choice({"type": "function", "name": "spawn_agent", "namespace": "other"})["function"] == {
        "name": "other__spawn_agent"
    }


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"type": "namespace", "tools": []}, "tools[0].name"),
        ({"type": "namespace", "name": "n", "tools": 3}, "tools[0].tools"),
        (ns("n", "f") | {"tools": [{"type": "web_search"}]}, "tools[0].tools[0]"),
    ],
)
def test_a_malformed_namespace_is_a_400_naming_it(tool: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as refused:
        ResponsesTools.parse([tool])
    assert refused.value.param == param


# ---- each API's words for a context overflow ------------------------------------------------------
def test_context_length_words_per_api() -> None:
    overflow, alone = ContextLengthError(18778, 32000, 32768), ContextLengthError(40000, None, 32768)
    assert context_length_error(overflow, MESSAGES).message == (
        "input length and `max_tokens` exceed context limit: 18778 + 32000 > 32768, decrease input length or "
        "`max_tokens` and try again"
    )
    assert context_length_error(alone, MESSAGES).message == "prompt is too long: 40000 tokens > 32767 maximum"
    assert context_length_error(overflow, CHAT).message == (
        "This model's maximum context length is 32768 tokens. However, you requested 50778 tokens (18778 in the "
        "messages, 32000 in the completion). Please reduce the length of the messages or completion."
    )
    refused = context_length_error(ContextLengthError(40000, None, 32768, at_least=True), COMPLETIONS)
    assert "your prompt resulted in at least 40000 tokens" in refused.message and refused.param == "prompt"
    assert (context_length_error(overflow, RESPONSES).param, refused.code) == (
        "max_output_tokens",
        "context_length_exceeded",
    )


# ---- Anthropic's mapping and usage ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("thinking", "enable"),
    [
        (None, False),
        ({"type": "disabled"}, False),
        ({"type": "enabled", "budget_tokens": 1024}, True),
        ({"type": "adaptive"}, None),
    ],
)
def test_thinking_follows_anthropics_semantics(thinking: dict[str, Any] | None, enable: bool | None) -> None:
    body = {"max_tokens": 5, "messages": [{"role": U, "content": "a"}], "thinking": thinking}
    chat = validate(MessagesRequestModel, body).to_chat_request()
    assert chat.template_kwargs.get("enable_thinking") == enable


def test_a_forced_call_turns_thinking_off_unless_the_request_asked_for_it() -> None:
    tool = {"name": "f", "input_schema": {"type": "object"}}
    body = {"max_tokens": 5, "messages": [{"role": U, "content": "a"}], "tools": [tool], "tool_choice": {"type": "any"}}
    assert validate(
        MessagesRequestModel, {**body, "thinking": {"type": "adaptive"}}
    ).to_chat_request().template_kwargs == {"enable_thinking": False}
    assert validate(
        MessagesRequestModel, {**body, "thinking": {"type": "enabled", "budget_tokens": 9}}
    ).to_chat_request().template_kwargs == {"enable_thinking": True}


def test_usage_splits_the_prompt_into_uncached_and_cached() -> None:
    assert usage(100, 64, 7) == {
        "input_tokens": 36,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 64,
        "output_tokens": 7,
    }


# ---- depth, refusals, flags ------------------------------------------------------------------------
def test_the_depth_check_measures_any_depth_without_recursion() -> None:
    deep: Any = 1
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(APIError) as refused:
        check_depth(deep, "x")
    assert refused.value.message == "x is nested deeper than 128 levels"
    check_depth({"a": [{"b": 1}]}, "x")


def test_the_rejected_metric_reason_is_the_code_else_the_type() -> None:
    assert rejection_reason(ErrorBody("m", "invalid_request_error", "max_tokens", "context_length_exceeded")) == (
        "context_length_exceeded"
    )
    assert rejection_reason(ErrorBody("m", "invalid_request_error")) == "invalid_request_error"
    assert rejection_reason(ErrorBody("m", "overloaded_error", code="server_overloaded")) == "overloaded"


def test_the_front_flags_map_onto_their_fields() -> None:
    config = server_config(
        build_parser().parse_args(
            [
                "serve",
                "--max-tokens-policy",
                "reject",
                "--generation-config",
                "vllm",
                "--access-log",
                "--disable-access-log-for-endpoints",
                "",
            ]
        )
    )
    assert (config.max_tokens_policy, config.engine.generation_config) == ("reject", "vllm")
    assert (config.access_log, config.access_log_skipped_paths) == (True, ())
    default = server_config(build_parser().parse_args(["serve"]))
    assert (default.max_tokens_policy, default.engine.generation_config, default.access_log) == ("clamp", "auto", False)


def test_models_root_names_a_folder_by_its_last_part_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from api.routes import public_root

    folder = tmp_path / "Qwen3-8B-NVFP4"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    assert public_root(str(folder), "qwen") == "Qwen3-8B-NVFP4"
    assert public_root("Qwen3-8B-NVFP4", "qwen") == "Qwen3-8B-NVFP4"  # relative, and there
    assert public_root("./Qwen3-8B-NVFP4/", "qwen") == "Qwen3-8B-NVFP4"
    assert public_root("Qwen/Qwen3-8B", "qwen") == "Qwen/Qwen3-8B"  # a hub name, as given
    assert public_root(None, "fp4serve-demo-qwen3") == "fp4serve-demo-qwen3"
    assert str(tmp_path) not in public_root(str(tmp_path / "gone" / "model.gguf"), "qwen")


def test_a_tool_schema_may_nest_64_levels_as_response_format_may_and_no_more() -> None:
    from api.request.messages import function_tool

    def nested(levels: int) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "string"}
        for _ in range(levels - 1):
            schema = {"type": "object", "properties": {"a": schema}}
        return schema

    function_tool({"name": "f", "parameters": nested(64)}, "name", "parameters")
    with pytest.raises(APIError) as refused:
        function_tool({"name": "f", "parameters": nested(65)}, "name", "parameters")
    assert (refused.value.status, refused.value.param) == (400, "parameters")
