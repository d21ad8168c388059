"""The agent test models (fp4serve_tools/agent_model.py) as the CLI tests rely on them, served by
the normal engine with `--tool-parser auto --reasoning-parser auto` and read with the `openai` SDK:
a first turn whose user message holds a call is that call, parsed, with the same tokens that
`transformers` generates from the same prompt ids; the turn after the tool result is the result's
first line; an agent-sized prompt (the README's start as the system prompt, 30 tools) still gets the call;
a request that asks for no call gets an empty answer. The XML model writes Qwen3-Coder calls the
same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.agents.harness import AgentServer, agent_server

pytestmark = pytest.mark.slow  # every test serves a model

REPO = Path(__file__).resolve().parents[2]
PATH = "/srv/project-7f3a/docs/notes_2026.txt"


def tool(name: str, description: str, **params: str) -> dict[str, Any]:
    properties = {p: {"type": "string", "description": d} for p, d in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(params)},
        },
    }


TOOLS = [
    tool("read_file", "Read a file from the workspace.", file_path="The absolute path of the file."),
    tool("run_shell_command", "Run a shell command.", command="The command line."),
    tool("write_file", "Write a file.", file_path="Where to write.", content="What to write."),
]


def agent_sized_tools() -> list[dict[str, Any]]:
    """30 tools with long descriptions, as the CLIs send (their prose taken from this README)."""
    paragraphs = [p for p in (REPO / "README.md").read_text().split("\n\n") if len(p) > 200]
    names = [
        "Bash",
        "Glob",
        "Grep",
        "LS",
        "Read",
        "Edit",
        "MultiEdit",
        "Write",
        "NotebookEdit",
        "WebFetch",
        "TodoWrite",
        "WebSearch",
        "Task",
        "ExitPlanMode",
        "apply_patch",
        "update_plan",
        "view_image",
        "exec_command",
        "write_stdin",
        "read_file",
        "write_file",
        "glob",
        "grep_search",
        "list_directory",
        "run_shell_command",
        "save_memory",
        "todo_write",
        "task",
        "skill",
        "question",
    ]
    return [
        tool(
            n,
            paragraphs[i % len(paragraphs)],
            **{"file_path" if i % 2 else "command": paragraphs[(i + 7) % len(paragraphs)][:300]},
        )
        for i, n in enumerate(names)
    ]


def json_call(name: str, arguments: dict[str, str]) -> str:
    return f"Please make this call\n<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def xml_call(name: str, arguments: dict[str, str]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"Please make this call\n<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def after_result(request_text: str, name: str, arguments: dict[str, str], result: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": request_text},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]


@pytest.fixture(scope="module")
def served(served_agent: AgentServer) -> AgentServer:
    return served_agent  # shared with tests/agents/test_clis.py (tests/agents/conftest.py)


@pytest.fixture(scope="module")
def client(served: AgentServer) -> openai.OpenAI:
    return served.server.openai(timeout=300)


def ask(
    client: openai.OpenAI,
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = TOOLS,
    **kwargs: Any,
) -> Any:
    extra = {"tools": tools} if tools else {}
    return client.chat.completions.create(model=model, messages=messages, max_tokens=200, **extra, **kwargs)


def test_a_first_turn_is_the_call_from_the_prompt_token_for_token_as_transformers(
    agent_model: Path, served: AgentServer, client: openai.OpenAI
) -> None:
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": json_call("read_file", {"file_path": PATH})},
    ]
    response = ask(client, served.model, messages, extra_body={"return_token_ids": True})
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"file_path": PATH}
    assert not choice.message.content

    tokenizer = AutoTokenizer.from_pretrained(str(agent_model))
    prompt_ids = response.model_extra["prompt_token_ids"]
    assert (
        prompt_ids
        == tokenizer.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    model = Qwen3ForCausalLM.from_pretrained(str(agent_model), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt_ids]), max_new_tokens=60, do_sample=False)[0, len(prompt_ids) :]
    assert choice.model_extra["token_ids"] == theirs.tolist()


def test_the_turn_after_the_tool_result_is_its_first_line(served: AgentServer, client: openai.OpenAI) -> None:
    arguments = {"command": f"cat {PATH}"}
    messages = after_result(
        json_call("run_shell_command", arguments),
        "run_shell_command",
        arguments,
        "the secret word is zebra-42\nand a second line",
    )
    [choice] = ask(client, served.model, messages).choices
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "the secret word is zebra-42"


def test_an_agent_sized_prompt_still_gets_the_call(served: AgentServer, client: openai.OpenAI) -> None:
    # NOTE: the README's first 20,000 characters: all of it (31k tokens with the tools) takes
    # minutes to prefill on a loaded 2-core CPU, and the CLIs' own prompts are 6-19k tokens.
    messages = [
        {"role": "system", "content": (REPO / "README.md").read_text()[:20_000]},
        {"role": "user", "content": "<system-reminder>\nThe date is Thursday.\n</system-reminder>"},
        {"role": "user", "content": json_call("Read", {"file_path": PATH})},
    ]
    response = ask(client, served.model, messages, agent_sized_tools())
    assert response.usage.prompt_tokens > 8_000, response.usage
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "Read" and json.loads(call.function.arguments) == {"file_path": PATH}


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["with-tools", "without-tools"])
def test_a_request_that_asks_for_no_call_gets_an_empty_answer(
    served: AgentServer, client: openai.OpenAI, tools: list[dict[str, Any]] | None
) -> None:
    [choice] = ask(
        client, served.model, [{"role": "user", "content": "Generate a short title for this chat."}], tools
    ).choices
    assert choice.finish_reason == "stop" and not choice.message.tool_calls and not choice.message.content


def test_the_xml_model_writes_qwen3_coder_calls(agent_model_xml: Path) -> None:
    arguments = {"file_path": PATH}
    with agent_server(agent_model_xml) as served:
        client = served.server.openai(timeout=300)
        [choice] = ask(client, served.model, [{"role": "user", "content": xml_call("read_file", arguments)}]).choices
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "read_file" and json.loads(call.function.arguments) == arguments
        messages = after_result(xml_call("read_file", arguments), "read_file", arguments, "zebra-42\nmore")
        [after] = ask(client, served.model, messages).choices
        assert after.finish_reason == "stop" and after.message.content == "zebra-42"
