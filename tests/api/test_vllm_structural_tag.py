"""vLLM's `structured_outputs.structural_tag` through the official `openai` SDK's `extra_body`, against
a real server on the demo's random-weight Qwen3 (tests/api/test_vllm_structured_outputs.py's): xgrammar's
structural tag, in its current form (a tag around its content binds the whole output) and vLLM's
older `structures` / `triggers` form, on chat and completions; a malformed one is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.api.test_vllm_structured_outputs import chat, client, complete, server  # noqa: F401  (fixtures)

ANSWER = {
    "type": "object",
    "properties": {"pick": {"enum": ["alpha", "beta"]}},
    "required": ["pick"],
    "additionalProperties": False,
}
# A regex inside the tag: a JSON schema there would let the random model write whitespace until
# max_tokens (xgrammar's JSON allows any), which says nothing about the tag.
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<answer>",
        "content": {"type": "regex", "pattern": '\\{"pick": "(alpha|beta)"\\}'},
        "end": "</answer>",
    },
}
LEGACY = {
    "type": "structural_tag",
    "triggers": ["<function="],
    "structures": [{"begin": "<function=pick>", "schema": ANSWER, "end": "</function>"}],
}


def text_of(choice: Any) -> str:
    return choice.message.content if hasattr(choice, "message") else choice.text


@pytest.mark.parametrize("call", [chat, complete])
@pytest.mark.parametrize("as_text", [True, False])
def test_a_tag_binds_the_whole_output(client: openai.OpenAI, call: Any, as_text: bool) -> None:  # noqa: F811
    tag = json.dumps(TAG) if as_text else TAG  # vLLM takes JSON text; the object itself is accepted too
    choice = call(client, {"structured_outputs": {"structural_tag": tag}}, max_tokens=200)
    text = text_of(choice)
    assert choice.finish_reason == "stop", text
    assert text.startswith("<answer>") and text.endswith("</answer>"), text
    assert json.loads(text[len("<answer>") : -len("</answer>")])["pick"] in ("alpha", "beta")


def test_the_older_structures_and_triggers_form_is_taken(client: openai.OpenAI) -> None:  # noqa: F811
    # Free text until a trigger: the random model may never write one, so only the acceptance shows.
    choice = chat(client, {"structured_outputs": {"structural_tag": json.dumps(LEGACY)}}, max_tokens=8)
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("tag", "words", "param"),
    [
        ("{not json", "structural_tag is not JSON", "structural_tag"),
        (
            json.dumps({"type": "structural_tag", "format": {"type": "nope"}}),
            "invalid structural_tag",
            "structural_tag",
        ),
        (
            json.dumps({"structures": [{"begin": "<a>"}], "triggers": ["<a"]}),
            "needs begin, schema and end",
            "structural_tag",
        ),
        ("", "structural_tag must be xgrammar's structural tag as JSON text", "structured_outputs"),
    ],
)
def test_a_malformed_structural_tag_is_a_400_naming_it(
    client: openai.OpenAI,  # noqa: F811  (the fixture)
    tag: str,
    words: str,
    param: str,
) -> None:
    for call in (chat, complete):
        with pytest.raises(openai.BadRequestError) as e:
            call(client, {"structured_outputs": {"structural_tag": tag}})
        assert words in str(e.value.message)
        assert e.value.body["param"] == param
