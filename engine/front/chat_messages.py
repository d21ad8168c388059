"""What a chat template does with a conversation, found once by rendering probe conversations
(`TemplateTraits`), and the one rewrite of a conversation that a template cannot take as sent:
system messages after the first message, folded into the leading system prompt.

Agents send system messages anywhere: Claude Code's environment block is a `system` message after
the first user turn, Codex sends two `developer` messages in a row. Templates such as Qwen3's own
raise "System message must be at the beginning"; others (Llama 3, ChatML) render a system turn
wherever it stands. The probe tells which kind this template is."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler.request import ParamError

logger = logging.getLogger("fp4serve.engine")

# Texts no template can know: found in a rendering only if the template wrote them.
_PROBE_SYSTEM = "fp4serve-probe-system-7c2e"
_PROBE_TOOL_NAME = "fp4serve_probe_tool_7c2e"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_TOOL_NAME,
        "description": "A probe: does the chat template show tools to the model?",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}
_PROBE_USER = [{"role": "user", "content": "hello"}]
# A system prompt, a user turn, then a system message: the shape Claude Code and Codex send.
_PROBE_MID_SYSTEM = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "system", "content": _PROBE_SYSTEM},
    {"role": "user", "content": "go on"},
]
# Between folded system texts, as between a system prompt's paragraphs.
SYSTEM_SEPARATOR = "\n\n"

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


@dataclass(frozen=True)
class TemplateTraits:
    renders_tools: bool  # a request's tools reach the prompt
    renders_mid_system: bool  # a system message after the first one is rendered where it stands

    @staticmethod
    def probe(render: Render) -> TemplateTraits:
        """`render(messages, tools)`: the template's text (ParamError when it refuses them)."""
        return TemplateTraits(
            renders_tools=_renders(render, _PROBE_USER, [_PROBE_TOOL], _PROBE_TOOL_NAME),
            renders_mid_system=_renders(render, _PROBE_MID_SYSTEM, None, _PROBE_SYSTEM),
        )


def _renders(render: Render, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, mark: str) -> bool:
    try:
        return mark in render(messages, tools)
    except ParamError:
        return False


def template_probe(render: Render, where: str) -> TemplateTraits:
    """The traits of a checkpoint's template, with a start-up line for what it cannot take."""
    traits = TemplateTraits.probe(render)
    if not traits.renders_mid_system:
        logger.info(
            "the chat template of %s takes a system message only first: later system messages (agents "
            "send them mid-conversation) are appended to the system prompt",
            where,
        )
    return traits


def fold_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with every system message after the first message moved into the leading
    system prompt (one is made first if there was none), appended in order with a blank line
    between them. Messages are the normalised chat dicts (content a string)."""
    if not any(m.get("role") == "system" for m in messages[1:]):
        return messages
    leading = messages[0] if messages[0].get("role") == "system" else None
    body = messages[1:] if leading is not None else messages
    texts = [m["content"] for m in ([leading] if leading is not None else []) + body if m.get("role") == "system"]
    system = {**(leading or {}), "role": "system", "content": SYSTEM_SEPARATOR.join(t for t in texts if t)}
    return [system, *(m for m in body if m.get("role") != "system")]
