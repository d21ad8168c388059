"""The output processor on hand-built `EngineCoreOutputs` and a real tokenizer (tests/factories.py's
word tokenizer: tokens w0..w510 and <eos>, decoded joined by spaces): stop strings across token
boundaries (held back, released, cut, included), the n fan-in, prompt logprobs gathered over
prefill chunks, and every finish reason (stop, length, abort, error)."""

from __future__ import annotations

import pytest

from engine.core_types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, PromptLogprobsChunk
from engine.front.input_processor import InputProcessor
from engine.front.metrics import EngineMetrics
from engine.front.output_processor import OutputProcessor
from engine.front.outputs import RequestOutput
from engine.front.tokenizer import Tokenizer
from scheduler.request import SamplingParams
from tests.factories import EOS_ID, TINY, write_word_tokenizer

PROMPT = [3, 4, 5]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("words")
    write_word_tokenizer(path, TINY["vocab_size"])
    return Tokenizer(path)


def start(tokenizer: Tokenizer, **params: object) -> tuple[OutputProcessor, list[EngineCoreRequest]]:
    """An output processor holding one request "r" (its samples as the input processor fans them out)."""
    processor = OutputProcessor(tokenizer, EngineMetrics("test"))
    inputs = InputProcessor(tokenizer.vocab_size, 64, (EOS_ID,))
    children = inputs.process("r", PROMPT, SamplingParams(**params))  # type: ignore[arg-type]
    processor.add_request("r", children)
    return processor, children


def step(
    processor: OutputProcessor, *outputs: EngineCoreOutput, failed: tuple[str, ...] = (), error: str | None = None
) -> tuple[list[RequestOutput], list[str]]:
    return processor.process(EngineCoreOutputs(outputs=outputs, failed_request_ids=failed, error=error))


def feed(processor: OutputProcessor, child_id: str, token_ids: list[int]) -> tuple[list[RequestOutput], list[str]]:
    """One core output per token, until the processor ends the sample; every output and the ids it
    asked the core to abort."""
    got: list[RequestOutput] = []
    to_abort: list[str] = []
    for token_id in token_ids:
        outs, aborts = step(processor, EngineCoreOutput(child_id, (token_id,)))
        got.extend(outs)
        to_abort.extend(aborts)
        if outs and outs[-1].finished:
            break
    return got, to_abort


WORDS = [10, 11, 12, 13, 14, 15]  # "w10 w11 w12 w13 w14 w15"


@pytest.mark.parametrize(
    ("stop", "kept"),
    [
        ("1 w12", "w10 w1"),  # over two tokens: the end of w11, the space, w12
        ("1 w12 w1", "w10 w1"),  # over three tokens: the end of w11, w12, the start of w13
    ],
)
def test_a_stop_string_over_token_boundaries_ends_the_sample_before_it(
    tokenizer: Tokenizer, stop: str, kept: str
) -> None:
    processor, [child] = start(tokenizer, stop=(stop,), max_tokens=20)
    outs, to_abort = feed(processor, child.request_id, WORDS)
    assert "".join(o.text_delta for o in outs) == kept
    last = outs[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert to_abort == [child.request_id]  # the core still runs it: the front ends it
    assert sum(len(o.new_token_ids) for o in outs) == last.num_output_tokens == len(outs)


def test_with_include_stop_str_in_output_the_text_ends_with_the_stop_string(tokenizer: Tokenizer) -> None:
    processor, [child] = start(tokenizer, stop=("1 w12",), include_stop_str_in_output=True, max_tokens=20)
    outs, _ = feed(processor, child.request_id, WORDS)
    assert "".join(o.text_delta for o in outs) == "w10 w11 w12"


def test_text_held_back_as_a_stop_prefix_is_released_when_the_stop_does_not_complete(tokenizer: Tokenizer) -> None:
    # "w11" ends with "1", the start of the stop string "1 w99"; w12 follows instead of w99, and the
    # core ends the sample at its max_tokens.
    processor, [child] = start(tokenizer, stop=("1 w99",), max_tokens=4)
    outs, to_abort = feed(processor, child.request_id, [10, 11, 12])
    [last], aborts = step(processor, EngineCoreOutput(child.request_id, (13,), finish_reason="length"))
    deltas = [o.text_delta for o in [*outs, last]]
    assert "".join(deltas) == "w10 w11 w12 w13"
    assert "11" not in "".join(deltas[:2])  # held back while it could still start the stop string
    assert "11" in "".join(deltas[:3])  # released once it could not
    assert (last.finish_reason, last.stop_reason) == ("length", None) and to_abort == aborts == []


def test_n_samples_fan_in_to_their_request_each_with_its_own_index_and_counts(tokenizer: Tokenizer) -> None:
    processor, children = start(tokenizer, n=3, max_tokens=2)
    assert [c.request_id for c in children] == ["r#0", "r#1", "r#2"]
    first, _ = step(processor, *(EngineCoreOutput(c.request_id, (20 + i,)) for i, c in enumerate(children)))
    assert [(o.request_id, o.index, o.text_delta, o.num_output_tokens) for o in first] == [
        ("r", 0, "w20", 1),
        ("r", 1, "w21", 1),
        ("r", 2, "w22", 1),
    ]
    assert all(o.prompt_token_ids == tuple(PROMPT) for o in first)  # each sample's first output
    # Sample 1 ends first; the request lives on until every sample has.
    [one], _ = step(processor, EngineCoreOutput("r#1", (31,), finish_reason="length"))
    assert (one.index, one.finish_reason, one.num_output_tokens, one.prompt_token_ids) == (1, "length", 2, None)
    rest, _ = step(
        processor,
        EngineCoreOutput("r#0", (30,), finish_reason="length"),
        EngineCoreOutput("r#2", (32,), finish_reason="length"),
    )
    assert [(o.index, o.text_delta, o.finish_reason) for o in rest] == [(0, " w30", "length"), (2, " w32", "length")]
    assert processor.abort("r") == ([], [])  # nothing of it is left
    late, _ = step(processor, EngineCoreOutput("r#0", (40,)))  # an output the core sent before it learnt
    assert late == []


def test_prompt_logprobs_gathered_over_prefill_chunks_come_with_the_first_token(tokenizer: Tokenizer) -> None:
    processor, [child] = start(tokenizer, prompt_logprobs=1, max_tokens=3)
    rid = child.request_id
    # Chunk 1 scores position 1; chunk 2 positions 1-2 again (a preempted request recomputes) and 2.
    nothing, _ = step(
        processor, EngineCoreOutput(rid, (), prompt_logprobs=PromptLogprobsChunk(1, (-0.5,), ((7,),), ((-0.25,),)))
    )
    assert nothing == []  # a chunk that sampled nothing says nothing yet
    [first], _ = step(
        processor,
        EngineCoreOutput(
            rid, (50,), prompt_logprobs=PromptLogprobsChunk(1, (-9.0, -1.5), ((9,), (8,)), ((-9.0,), (-0.75,)))
        ),
    )
    entries = first.prompt_logprobs
    assert entries is not None and entries[0] is None and len(entries) == len(PROMPT)
    assert [(e.token_id, e.token, e.logprob) for e in entries[1:]] == [(4, "w4", -0.5), (5, "w5", -1.5)]
    assert [(t.token_id, t.token, t.logprob) for e in entries[1:] for t in e.top] == [
        (7, "w7", -0.25),
        (8, "w8", -0.75),
    ]
    [second], _ = step(processor, EngineCoreOutput(rid, (51,)))
    assert second.prompt_logprobs is None


@pytest.mark.parametrize(
    ("core_finish", "token_ids", "text", "stop_reason"),
    [
        ("stop", (60, EOS_ID), " w60", None),  # EOS: it ends the text without showing itself
        ("stop", (60, 77), " w60", 77),  # a stop token id
        ("length", (60, 61), " w60 w61", None),
    ],
)
def test_a_finish_from_the_core_ends_the_sample_with_its_reason(
    tokenizer: Tokenizer, core_finish: str, token_ids: tuple[int, ...], text: str, stop_reason: int | None
) -> None:
    processor, [child] = start(tokenizer, max_tokens=10, stop_token_ids=(77,))
    step(processor, EngineCoreOutput(child.request_id, (59,)))
    [last], to_abort = step(
        processor, EngineCoreOutput(child.request_id, token_ids, finish_reason=core_finish, stop_reason=stop_reason)
    )
    assert (last.text_delta, last.finish_reason, last.stop_reason) == (text, core_finish, stop_reason)
    assert last.new_token_ids == token_ids and last.num_output_tokens == 3 and to_abort == []


def test_abort_ends_every_live_sample_and_names_them_for_the_core(tokenizer: Tokenizer) -> None:
    processor, children = start(tokenizer, n=2, max_tokens=10)
    step(processor, EngineCoreOutput("r#0", (70,)))
    outs, child_ids = processor.abort("r")
    assert child_ids == [c.request_id for c in children]
    assert [(o.index, o.finish_reason, o.error) for o in outs] == [(0, "abort", None), (1, "abort", None)]


def test_a_failed_step_ends_its_samples_with_the_error(tokenizer: Tokenizer) -> None:
    processor, [child] = start(tokenizer, max_tokens=10)
    [out], to_abort = step(processor, failed=(child.request_id,), error="the engine failed (RuntimeError)")
    assert (out.finish_reason, out.error) == ("abort", "the engine failed (RuntimeError)") and to_abort == []
    assert processor.fail_all("dead") == []  # it is gone already
