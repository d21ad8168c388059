"""A Qwen3.5 hybrid (ConditionalGeneration layout) through the real server and the `openai` client:
greedy completions equal transformers', the start-up log names what was skipped and the state
slots, `--tool-parser auto` / `--reasoning-parser auto` pick the checkpoint template's formats,
chat_template_kwargs reach the template, and image content gets a clear 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_engine_correctness import hf_greedy
from tests.factories import make_hybrid_checkpoint
from tests.server_utils import HTTP, RunningServer, start_server

pytestmark = pytest.mark.slow

# A Qwen3.5-style template written for this test: tools in Qwen3-Coder's XML, a <think> block opened
# by the generation prompt, and past assistant reasoning kept only with preserve_thinking.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t.function.name }}\n{% endfor %}"
    "Call a tool as <tool_call>\n<function=NAME>\n<parameter=ARG>\nvalue\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content and preserve_thinking %}<think>\n{{ m.reasoning_content }}"
    "\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
QWEN_VOCAB = 151_936


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hybrid_checkpoint(
        tmp_path_factory.mktemp("qwen3_5_vl"), layout="vl", tie=False, vocab_size=QWEN_VOCAB, chat_template=TEMPLATE
    )


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RunningServer]:
    s = start_server(
        "--model",
        str(checkpoint),
        "--served-model-name",
        "qwen3_5_vl",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "4MiB",
        "--max-model-len",
        "256",
        "--num-state-slots",
        "2",
        "--max-num-batched-tokens",
        "32",
        "--tool-parser",
        "auto",
        "--reasoning-parser",
        "auto",
    )
    try:
        yield s
    finally:
        assert s.stop() == 0


def test_concurrent_greedy_completions_equal_transformers(server: RunningServer, checkpoint: Path) -> None:
    """Three requests, two state slots, 32-token steps: chunked, queued for a slot, reused slots."""
    import asyncio

    prompts = [[5, 9, 33, 7] * k for k in (1, 10, 17)]  # 4, 40 and 68 tokens
    refs = [hf_greedy(checkpoint, p, 10)[0] for p in prompts]

    async def run() -> list[Any]:
        async with server.async_openai(timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model="qwen3_5_vl",
                        prompt=p,
                        max_tokens=10,
                        temperature=0.0,
                        extra_body={"ignore_eos": True, "return_token_ids": True},
                    )
                    for p in prompts
                )
            )

    for out, ref in zip(asyncio.run(run()), refs, strict=True):
        assert out.choices[0].model_extra["token_ids"] == ref


def test_startup_log_names_skipped_weights_slots_and_parsers(server: RunningServer) -> None:
    log = server.log()
    assert "vision tensors (model.visual.*" in log and "this server serves text" in log
    assert "state slots: 2 x" in log
    assert "hybrid prefix caching on: " in log and "state checkpoints x" in log
    assert "tool parser qwen3_coder, reasoning parser qwen3" in log


def test_chat_template_kwargs_reach_the_checkpoint_template(server: RunningServer) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "They greet me."},
        {"role": "user", "content": "Bye"},
    ]

    def count(messages: list[dict[str, str]], preserve: bool) -> int:
        r = HTTP.post(
            server.url("/tokenize"),
            json={"messages": messages, "chat_template_kwargs": {"preserve_thinking": preserve}},
        )
        assert r.status_code == 200, r.text
        return r.json()["count"]

    without = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    assert count(messages, False) == count(without, False)
    assert count(messages, True) > count(without, True)  # the past reasoning only with preserve_thinking


def test_chat_with_image_content_is_a_clear_400(server: RunningServer) -> None:
    import openai

    with server.openai(timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="qwen3_5_vl",
                max_tokens=4,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        ],
                    }
                ],
            )
        assert "text only" in str(err.value.body)
        reply = client.chat.completions.create(
            model="qwen3_5_vl", max_tokens=4, temperature=0.0, messages=[{"role": "user", "content": "Hi"}]
        )
        assert reply.choices[0].finish_reason == "length"  # the server still serves everyone else
