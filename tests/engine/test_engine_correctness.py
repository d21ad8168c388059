"""Our engine against transformers, the reference implementation: float32 logits at every step,
and batched greedy decoding over the paged KV cache token for token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.front.offline import OfflineEngine
from scheduler.request import SamplingParams
from tests.factories import make_checkpoint

NUM_DECODE = 32
# 1 token; exactly one page; one past a page boundary; one short of it; several pages.
PROMPT_LENS = [1, 16, 17, 15, 2, 40, 64, 33, 5, 48, 31, 8]


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(path: Path, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy decoding with its own KV cache; returns tokens and each step's logits."""

    model = _hf_model(path)
    tokens: list[int] = []
    logits_per_step = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(num_tokens):
            logits = out.logits[0, -1].float()
            logits_per_step.append(logits)
            nxt = int(torch.argmax(logits))
            tokens.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logits_per_step


_HF_CACHE: dict[Path, Any] = {}


def _hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


def make_engine(path: Path, **overrides: Any) -> OfflineEngine:
    kwargs: dict[str, Any] = dict(model=str(path), dtype="float32", kv_cache_memory="16MiB", block_size=16)
    kwargs.update(overrides)
    return OfflineEngine.from_config(EngineConfig(**kwargs))


def capture_logits(engine: OfflineEngine) -> dict[str, list[torch.Tensor]]:
    """Record the logits each request samples from, step by step."""
    seen: dict[str, list[torch.Tensor]] = {}
    sampler = engine.core.runner.sampler
    original = sampler.launch  # what the runner calls: sampling, its read-back deferred

    def sample(logits: torch.Tensor, request_ids: list[str], *args: Any) -> Any:
        for row, rid in enumerate(request_ids):
            seen.setdefault(rid, []).append(logits[row].clone())
        return original(logits, request_ids, *args)

    sampler.launch = sample  # type: ignore[method-assign]
    return seen


ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


@pytest.mark.parametrize(
    "arch,rope,tie",
    [
        ("qwen3", "default", True),
        ("qwen3", "yarn", False),
        ("qwen3", "linear", True),
        ("llama", "llama3", False),
        ("llama", "default", True),
    ],
)
def test_every_step_logits_match_transformers(tmp_path: Path, arch: str, rope: str, tie: bool) -> None:
    path = make_checkpoint(tmp_path / "ckpt", arch, rope_scaling=ROPES[rope], tie=tie)
    prompt = prompts_for(512)[5]  # 40 tokens: several pages
    ref_tokens, ref_logits = hf_greedy(path, prompt, 8)
    engine = make_engine(path)
    seen = capture_logits(engine)
    [result] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert result.token_ids[0] == ref_tokens
    ours = seen[f"{result.request_id}#0"]
    assert len(ours) == 8
    for step, (a, b) in enumerate(zip(ours, ref_logits)):
        diff = (a - b).abs().max().item()
        assert diff <= 1e-4, f"step {step}: max abs logits diff {diff}"


def test_all_prefill_positions_match_transformers(qwen3_ckpt: Path) -> None:
    """Hidden states of every prompt position, not only the sampled one."""
    from engine.batch import build_forward_batch
    from scheduler.output import ScheduledRequest, SchedulerOutput

    engine = make_engine(qwen3_ckpt, block_size=4)
    runner = engine.core.runner
    prompt = prompts_for(512)[7]
    pages = tuple(range(10, 10 + (len(prompt) + 3) // 4))
    out = SchedulerOutput((ScheduledRequest("r", tuple(prompt), 0, pages, True),), ())
    batch = build_forward_batch(out, 4, runner.device)
    runner.backend.plan(batch)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, runner.backend)
        ours = runner.model.compute_logits(hidden)
    with torch.no_grad():
        ref = _hf_model(qwen3_ckpt)(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def greedy_refs(qwen3_ckpt: Path) -> list[list[int]]:
    return [hf_greedy(qwen3_ckpt, p, NUM_DECODE)[0] for p in prompts_for(512)]


@pytest.mark.parametrize(
    "block_size,max_batched",
    [(16, 4096), (1, 4096), (16, 7), (1, 13)],
    ids=["page16", "page1", "page16-chunked", "page1-chunked"],
)
def test_batched_greedy_equals_transformers_alone(
    qwen3_ckpt: Path, greedy_refs: list[list[int]], block_size: int, max_batched: int
) -> None:
    engine = make_engine(qwen3_ckpt, block_size=block_size, max_num_batched_tokens=max_batched)
    results = engine.generate(prompts_for(512), SamplingParams(max_tokens=NUM_DECODE, temperature=0.0, ignore_eos=True))
    for i, (r, ref) in enumerate(zip(results, greedy_refs)):
        assert r.token_ids[0] == ref, f"prompt {i} (len {PROMPT_LENS[i]}) diverged"
        assert r.finish_reasons == ["length"]
    if max_batched < 64:  # the long prompts really were split into chunks
        assert engine.timings.num_steps > NUM_DECODE + max(PROMPT_LENS) // max_batched


def test_llama_batched_greedy_equals_transformers(llama_ckpt: Path) -> None:
    prompts = prompts_for(512)[:6]
    refs = [hf_greedy(llama_ckpt, p, 16)[0] for p in prompts]
    engine = make_engine(llama_ckpt, block_size=8)
    results = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [r.token_ids[0] for r in results] == refs
