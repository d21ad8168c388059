"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against transformers' log-softmax, through
chunked prefill, batching with other requests and a prompt the prefix cache already holds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core_types import EngineCoreRequest
from engine.front.offline import OfflineEngine
from engine.front.outputs import RequestOutput, TokenLogprob
from scheduler.request import ParamError, SamplingParams

NUM_TOP = 3


def reference(path: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab] float32: transformers' log-softmax scoring prompt[1:]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(dim=-1)


def first_output(engine: OfflineEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
    return [r.outputs[0][0] for r in engine.generate(prompts, params)]


def assert_matches(entries: tuple[TokenLogprob | None, ...], prompt: list[int], want: torch.Tensor) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:], 1):
        assert entry is not None and entry.token_id == prompt[p]
        assert entry.logprob == pytest.approx(float(want[p - 1, prompt[p]]), abs=1e-4)
        values, ids = want[p - 1].topk(NUM_TOP)
        assert [t.token_id for t in entry.top] == ids.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_match_transformers_through_chunked_prefill_and_batching(qwen3_ckpt: Path) -> None:
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (45, 20, 2)]
    # 16-token budget: the 45-token prompt prefills in chunks, beside the others' rows and decodes.
    engine = OfflineEngine.from_config(
        EngineConfig(model=str(qwen3_ckpt), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16)
    )
    asking = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=NUM_TOP, ignore_eos=True)
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = first_output(engine, prompts, [asking, plain, asking])
    assert outs[1].prompt_logprobs is None
    for i in (0, 2):
        entries = outs[i].prompt_logprobs
        assert entries is not None
        assert_matches(entries, prompts[i], reference(qwen3_ckpt, prompts[i]))


def test_a_cached_prompt_is_recomputed_for_prompt_logprobs(qwen3_ckpt: Path) -> None:
    prompt = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = OfflineEngine.from_config(EngineConfig(model=str(qwen3_ckpt), dtype="float32", kv_cache_memory="4MiB"))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    [warm] = first_output(engine, [prompt], [params])
    [again] = first_output(engine, [prompt], [params])
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens == 32  # the cache holds two full pages
    [scored] = first_output(engine, [prompt], [SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=NUM_TOP)])
    assert scored.num_cached_tokens == 0
    assert scored.prompt_logprobs is not None
    assert_matches(scored.prompt_logprobs, prompt, reference(qwen3_ckpt, prompt))


def test_prompt_logprobs_outside_0_to_20_are_a_param_error() -> None:
    with pytest.raises(ParamError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)


def test_preempted_requests_keep_their_prompt_logprobs_whole(qwen3_ckpt: Path) -> None:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 500, (30,), generator=g).tolist() for _ in range(3)]
    # 24 pages of 4 tokens hold 96 tokens; three requests of 30 + 24 tokens must preempt.
    engine = OfflineEngine.from_config(
        EngineConfig(
            model=str(qwen3_ckpt),
            dtype="float32",
            block_size=4,
            kv_cache_memory=str(512 * 4 * 24),
            max_num_batched_tokens=16,
        )
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=NUM_TOP, ignore_eos=True)
    outs = first_output(engine, prompts, [params] * 3)
    assert engine.core.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.prompt_logprobs is not None
        assert_matches(out.prompt_logprobs, prompt, reference(qwen3_ckpt, prompt))


def test_the_core_sends_prompt_logprobs_as_ids_and_floats_per_prefill_chunk(qwen3_ckpt: Path) -> None:
    engine = OfflineEngine.from_config(
        EngineConfig(model=str(qwen3_ckpt), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16)
    )
    prompt = list(range(200, 240))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    engine.core.add_request(EngineCoreRequest("r#0", tuple(prompt), params, (), time.monotonic()))
    outputs = [out for _ in range(3) for out in engine.core.step().outputs]
    assert [len(out.new_token_ids) for out in outputs] == [0, 0, 1]  # chunks of 16, 16 and 8 tokens
    chunks = [out.prompt_logprobs for out in outputs]
    assert [(c.start, len(c.logprobs)) for c in chunks if c is not None] == [(1, 16), (17, 16), (33, 7)]
    for chunk in chunks:
        assert chunk is not None and all(isinstance(lp, float) for lp in chunk.logprobs)
        assert all(len(ids) == 2 and all(isinstance(t, int) for t in ids) for ids in chunk.top_ids)
    assert not engine.core.has_unfinished()
