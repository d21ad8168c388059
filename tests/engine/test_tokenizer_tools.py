"""Whether the checkpoint's chat template shows the model a request's tools (engine/front/tokenizer.py):
found at load by rendering a probe tool, with a start-up warning when it does not (SmolLM2's
default template), so a tool request is never silently a plain chat."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import pytest

from engine.front.tokenizer import Tokenizer
from engine.weights.demo_model import chat_template_text
from engine.weights.model_source import smollm2_gguf_path
from engine.weights.qwen_tokenizer import write_qwen_tokenizer_files

WARNING = "does not render tools"


def smollm2_chat_template() -> str:
    """The chat template in the default model's GGUF metadata, as `fp4serve serve` loads it."""
    field = gguf.GGUFReader(str(smollm2_gguf_path())).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def tokenizer_with(tmp_path: Path, template: str) -> Tokenizer:
    write_qwen_tokenizer_files(tmp_path, template)
    return Tokenizer(tmp_path)


def test_smollm2s_default_template_drops_tools_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    template = smollm2_chat_template()
    with caplog.at_level(logging.WARNING, logger="fp4serve.tokenizer"):
        tokenizer = tokenizer_with(tmp_path, template)
    assert tokenizer.template_renders_tools is False
    assert [r for r in caplog.records if WARNING in r.getMessage() and r.levelno == logging.WARNING]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.render_chat(messages, [tool]) == tokenizer.render_chat(messages, None)


def test_the_qwen3_template_renders_tools_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fp4serve.tokenizer"):
        tokenizer = tokenizer_with(tmp_path, chat_template_text())
    assert tokenizer.template_renders_tools is True
    assert not [r for r in caplog.records if WARNING in r.getMessage()]


def test_a_template_that_fails_on_tools_does_not_render_them(tmp_path: Path) -> None:
    template = (
        "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    assert tokenizer_with(tmp_path, template).template_renders_tools is False


def test_a_template_that_mentions_tools_without_writing_them_does_not_count(tmp_path: Path) -> None:
    template = (
        "{% if tools %}You have {{ tools | length }} tools.\n{% endif %}"
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    )
    assert tokenizer_with(tmp_path, template).template_renders_tools is False
