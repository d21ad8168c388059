"""The agent test model (fp4serve_tools/agent_model.py) as the CLI tests rely on it: a Qwen3
checkpoint that `transformers` runs the same as the trainer did, served by the normal engine with
`--tool-parser auto --reasoning-parser auto` and read with the `openai` SDK. A first turn that names
a tool is a parsed tool call with the arguments copied from the prompt, also under an agent-sized
prompt it never saw in training (this README as the system prompt, 30 tools); the turn after the
tool result is a plain answer quoting the result; anything else gets its fixed answer. The XML
model writes Qwen3-Coder calls the same way."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from safetensors.torch import load_file

from fp4serve_tools.agent_conversations import FALLBACK_ANSWER, RESULT_PREFIX
from fp4serve_tools.agent_model import RECIPE_FILE, AgentRecipe, TinyQwen3
from tests.agents.harness import AgentServer, agent_server

pytestmark = pytest.mark.slow  # the first use trains the models (minutes), every test serves one

REPO = Path(__file__).resolve().parents[2]
PATH = "/srv/project-7f3a/docs/notes_2026.txt"


def tool(name: str, description: str, **params: str) -> dict[str, Any]:
    properties = {p: {"type": "string", "description": d} for p, d in params.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(params)}}}


TOOLS = [
    tool("read_file", "Read a file from the workspace.", file_path="The absolute path of the file."),
    tool("run_shell_command", "Run a shell command.", command="The command line."),
    tool("write_file", "Write a file.", file_path="Where to write.", content="What to write."),
]


def agent_sized_tools() -> list[dict[str, Any]]:
    """30 tools with long descriptions, as the CLIs send (their prose taken from this README)."""
    paragraphs = [p for p in (REPO / "README.md").read_text().split("\n\n") if len(p) > 200]
    names = ["Bash", "Glob", "Grep", "LS", "Read", "Edit", "MultiEdit", "Write", "NotebookEdit", "WebFetch",
             "TodoWrite", "WebSearch", "Task", "ExitPlanMode", "apply_patch", "update_plan", "view_image",
             "exec_command", "write_stdin", "read_file", "write_file", "glob", "grep_search", "list_directory",
             "run_shell_command", "save_memory", "todo_write", "task", "skill", "question"]
    return [tool(n, paragraphs[i % len(paragraphs)], **{"file_path" if i % 2 else "command": paragraphs[(i + 7) % len(paragraphs)][:300]})
            for i, n in enumerate(names)]


@pytest.fixture(scope="module")
def served(agent_model: Path) -> Iterator[AgentServer]:
    with agent_server(agent_model) as server:
        yield server


@pytest.fixture(scope="module")
def client(served: AgentServer) -> openai.OpenAI:
    return served.server.openai(timeout=300)


def ask(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = TOOLS,
        **kwargs: Any) -> Any:
    extra = {"tools": tools} if tools else {}
    return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=300, **extra,
                                          **kwargs).choices[0]


def request(name: str, arguments: dict[str, str]) -> str:
    return f'Call "{name}" with {json.dumps(arguments)}'


def test_the_checkpoint_runs_in_transformers_as_it_was_trained(agent_model: Path) -> None:
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    recipe_fields = json.loads((agent_model / RECIPE_FILE).read_text())
    recipe = AgentRecipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in recipe_fields.items()
                            if k in AgentRecipe.__dataclass_fields__})
    ours = TinyQwen3(recipe)
    weights = {k: v.float() for k, v in load_file(str(agent_model / "model.safetensors")).items()}
    ours.load_state_dict(weights)
    theirs = Qwen3ForCausalLM.from_pretrained(str(agent_model), torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(agent_model))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": request("read_file", {"file_path": PATH})}],
                                           tools=TOOLS, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        expected = theirs(ids).logits[0]
        got = ours.logits(ours.hidden(ids)[0])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)


def test_a_first_turn_is_a_call_with_the_arguments_from_the_prompt(served: AgentServer, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": request("read_file", {"file_path": PATH})}]
    choice = ask(client, served.model, messages)
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"file_path": PATH}
    assert not choice.message.content


def test_the_turn_after_the_tool_result_is_a_plain_answer_quoting_it(served: AgentServer, client: openai.OpenAI) -> None:
    arguments = {"command": f"cat {PATH}"}
    messages = [
        {"role": "user", "content": request("run_shell_command", arguments)},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "run_shell_command", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "the secret word is zebra-42\nand a second line"},
    ]
    choice = ask(client, served.model, messages)
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == RESULT_PREFIX + "the secret word is zebra-42"


def test_an_agent_sized_prompt_still_gets_the_call(served: AgentServer, client: openai.OpenAI) -> None:
    readme = (REPO / "README.md").read_text()
    messages = [{"role": "system", "content": readme},
                {"role": "user", "content": "<system-reminder>\nThe date is Thursday.\n</system-reminder>"},
                {"role": "user", "content": request("Read", {"file_path": PATH})}]
    choice = ask(client, served.model, messages, agent_sized_tools())
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "Read" and json.loads(call.function.arguments) == {"file_path": PATH}


def test_a_request_naming_no_tool_gets_the_fixed_answer(served: AgentServer, client: openai.OpenAI) -> None:
    choice = ask(client, served.model, [{"role": "user", "content": "Generate a short title for this chat."}], None)
    assert choice.finish_reason == "stop" and choice.message.content == FALLBACK_ANSWER


def test_the_xml_model_writes_qwen3_coder_calls(agent_model_xml: Path) -> None:
    request_text = f"Call this function:\n<function=read_file>\n<parameter=file_path>\n{PATH}\n</parameter>\n</function>"
    with agent_server(agent_model_xml) as served:
        client = served.server.openai(timeout=300)
        choice = ask(client, served.model, [{"role": "user", "content": request_text}])
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"file_path": PATH}
        messages = [{"role": "user", "content": request_text},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                        "name": "read_file", "arguments": json.dumps({"file_path": PATH})}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "zebra-42"}]
        after = ask(client, served.model, messages)
        assert after.finish_reason == "stop" and after.message.content == RESULT_PREFIX + "zebra-42"
