"""What the server does for a checkpoint whose chat template takes a system message only first and
never shows tools (Qwen3.5's template raises "System message must be at the beginning"; SmolLM2's
ignores tools), and whose generation_config.json asks for greedy sampling: the demo model's weights
in a folder with that template and that file, served in this process (hypercorn on 127.0.0.1) and
read with the official `openai` and `anthropic` SDKs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from api.app import ServerConfig
from engine.config import EngineConfig
from engine.weights.demo_model import ensure_demo_model
from tests.server_utils import HTTP, InProcessServer, in_process_server

NAME = "first-system-only"
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def checkpoint(dst: Path) -> Path:
    """The demo model's weights and tokenizer, with TEMPLATE and a greedy generation_config.json."""
    demo = ensure_demo_model()
    dst.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(demo / name, dst / name)
    (dst / "model.safetensors").symlink_to(demo / "model.safetensors")
    config = json.loads((demo / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    generation = json.loads((demo / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0}))
    return dst


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    folder = checkpoint(tmp_path_factory.mktemp("template") / "model")
    engine = EngineConfig(
        model=str(folder), served_model_name=NAME, kv_cache_memory="32MiB", max_model_len=1024, engine_process=False
    )
    with in_process_server(ServerConfig(engine=engine, access_log=True)) as running:
        yield running


@pytest.fixture
def rendered(server: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> list[list[dict[str, Any]]]:
    """The messages each request handed the chat template."""
    tokenizer = server.engine.input_processor.tokenizer
    calls: list[list[dict[str, Any]]] = []
    real: Callable[..., str] = tokenizer.render_chat

    def render(messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> str:
        calls.append(messages)
        return real(messages, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "render_chat", render)
    return calls


def test_a_mid_conversation_system_message_is_folded_into_the_system_prompt(
    server: InProcessServer, rendered: list[Any]
) -> None:
    client = anthropic.Anthropic(base_url=server.url(""), api_key="unused", max_retries=0, timeout=120)
    message = client.messages.create(
        model=NAME,
        max_tokens=5,
        system="Be brief.",
        messages=[
            {"role": "user", "content": "hello"},
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
            {"role": "user", "content": "go on"},
        ],
    )
    assert message.usage.output_tokens > 0
    assert rendered[-1] == [
        {"role": "system", "content": "Be brief.\n\n# Environment"},
        {"role": "user", "content": "hello"},
        {"role": "user", "content": "go on"},
    ]


def test_developer_items_after_the_first_are_folded_in_order(server: InProcessServer, rendered: list[Any]) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
    client.responses.create(
        model=NAME,
        max_output_tokens=5,
        input=[
            {"type": "message", "role": "developer", "content": "You are Codex."},
            {"type": "message", "role": "developer", "content": "Skills: none."},
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "message", "role": "system", "content": "Be brief."},
        ],
    )
    assert rendered[-1][0] == {"role": "system", "content": "You are Codex.\n\nSkills: none.\n\nBe brief."}
    assert [m["role"] for m in rendered[-1]] == ["system", "user"]


def test_tools_the_template_ignores_get_a_warning_header_and_a_log_line(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": NAME, "max_tokens": 3, "messages": [{"role": "user", "content": "time?"}]}
    with caplog.at_level("WARNING", logger="fp4serve.api"):
        with_tools = HTTP.post(server.url("/v1/chat/completions"), json={**body, "tools": [TOOL]}, timeout=120)
    assert with_tools.status_code == 200
    assert with_tools.headers["x-fp4serve-warning"] == "the chat template ignores tools: the model never saw them"
    assert any("does not render tools" in r.getMessage() for r in caplog.records)
    without = HTTP.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert "x-fp4serve-warning" not in without.headers


def test_generation_config_defaults_apply_to_absent_fields_and_a_request_value_wins(server: InProcessServer) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)

    def text(**kwargs: Any) -> str:
        reply = client.completions.create(
            model=NAME, prompt="Once upon a time", max_tokens=12, extra_body={"ignore_eos": True}, **kwargs
        )
        return reply.choices[0].text

    assert server.engine.info.sampling_defaults[0] == ("temperature", 0.0)
    greedy = text(temperature=0)
    assert text(seed=1) == text(seed=2) == greedy  # the file's temperature 0
    assert len({text(seed=s, temperature=1.0) for s in (1, 2, 3)}) > 1  # the request's own value


def test_the_access_log_has_one_line_per_request_but_for_the_skipped_paths(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="fp4serve.access"):
        assert HTTP.get(server.url("/v1/models"), timeout=30).status_code == 200
        assert HTTP.get(server.url("/health"), timeout=30).status_code == 200
    [line] = [r.getMessage() for r in caplog.records if r.name == "fp4serve.access"]
    assert line.startswith("127.0.0.1 GET /v1/models 200 key=default ")
