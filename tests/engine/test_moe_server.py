"""A tiny Qwen3-MoE checkpoint served as users meet it: a real server on 127.0.0.1 read with the
official `openai` client. Concurrent greedy completions under forced chunked prefill equal
transformers'; `--tool-parser auto` picks qwen3_coder from a Qwen3-Coder chat template;
`--quantization nvfp4` serves the same model with NVFP4 experts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.engine.test_engine_correctness import hf_greedy, prompts_for
from tests.factories import make_moe_checkpoint
from tests.server_utils import running_server

pytestmark = pytest.mark.slow

# The tool section of a Qwen3-Coder chat template: it teaches the XML call format.
CODER_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n<function>\\n<name>' ~ tool.function.name ~ '</name>\\n</function>' }}{%- endfor %}"  # noqa: E501
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format:\\n\\n<tool_call>\\n"
    "<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n"
    "</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NUM_TOKENS = 10


@pytest.fixture(scope="module")
def coder_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_moe_checkpoint(tmp_path_factory.mktemp("coder-moe"), seed=4, mlp_only_layers=[1])
    (path / "chat_template.jinja").write_text(CODER_TOOLS_TEMPLATE)  # where transformers 5 and Qwen put it
    return path


async def complete_all(client: object, model: str, prompts: list[list[int]]) -> list[list[int]]:
    async def one(prompt: list[int]) -> list[int]:
        out = await client.completions.create(  # type: ignore[attr-defined]
            model=model,
            prompt=prompt,
            max_tokens=NUM_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return list(out.choices[0].token_ids)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_concurrent_greedy_completions_equal_transformers_with_coder_tool_parser(coder_moe: Path) -> None:
    prompts = prompts_for(512)[:8]
    refs = [hf_greedy(coder_moe, p, NUM_TOKENS)[0] for p in prompts]
    with running_server(
        "--model",
        str(coder_moe),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "8MiB",
        "--max-num-batched-tokens",
        "7",
        "--tool-parser",
        "auto",
    ) as server:
        got = asyncio.run(complete_all(server.async_openai(), server_model(server), prompts))
        log = server.log()
    assert got == refs
    assert "tool parser qwen3_coder" in log
    assert "moe: 2 sparse layers x 8 experts (2 active per token)" in log


def test_nvfp4_serves_the_moe_checkpoint(coder_moe: Path) -> None:
    prompts = prompts_for(512)[:4]
    with running_server(
        "--model", str(coder_moe), "--dtype", "float32", "--kv-cache-memory", "8MiB", "--quantization", "nvfp4"
    ) as server:
        got = asyncio.run(complete_all(server.async_openai(), server_model(server), prompts))
        log = server.log()
    assert [len(t) for t in got] == [NUM_TOKENS] * 4
    assert "(nvfp4)" in log and "float linears quantized to NVFP4 at load" in log


def server_model(server: object) -> str:
    return server.openai().models.list().data[0].id  # type: ignore[attr-defined]
