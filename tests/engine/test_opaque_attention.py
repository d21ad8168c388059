"""The attention as one opaque custom op: the decode forward traces as a single graph (no breaks),
and greedy decoding through it gives the tokens of the eager engine."""

from __future__ import annotations

from pathlib import Path

import torch
from torch._dynamo.testing import CompileCounter

from bench.compile_probe import compiled_decode_forward, fill_decode_batch
from engine.attention.opaque import OpaqueAttention
from engine.attention.torch_ref import TorchAttentionBackend
from engine.config import EngineConfig
from engine.front.offline import OfflineEngine
from tests.engine.test_fast_decode_paths import _decode_batch


def test_the_op_returns_the_backends_output_and_writes_the_same_cache() -> None:
    bs, hq, hkv, d, seq_lens = 16, 6, 2, 8, [5, 16, 17, 40, 3]
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(sum(-(-n // bs) for n in seq_lens) + 1, 2, bs, hkv, d, generator=g)
    q = torch.randn(len(seq_lens), hq, d, generator=g)
    k, v = torch.randn(len(seq_lens), hkv, d, generator=g), torch.randn(len(seq_lens), hkv, d, generator=g)
    backend = TorchAttentionBackend(hq, hkv, d, torch.device("cpu"))
    backend.plan(_decode_batch(seq_lens, bs, list(range(len(seq_lens)))))
    want_cache = cache.clone()
    want = backend.forward(q, k, v, want_cache)
    opaque = OpaqueAttention(backend)
    got = opaque.forward(q, k, v, cache)
    assert torch.equal(got, want) and torch.equal(cache, want_cache)
    storage = got.untyped_storage().data_ptr()
    assert all(storage != t.untyped_storage().data_ptr() for t in (q, k, v, cache))  # no alias of an input


def _greedy_tokens(engine: OfflineEngine, batch_size: int, steps: int) -> list[list[int]]:
    ids = fill_decode_batch(engine, batch_size, prompt_len=6, max_tokens=steps + 4)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(steps):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    for request_id in ids:
        engine.abort(request_id)
    return [tokens[i] for i in ids]


def test_the_decode_forward_is_one_graph_and_decodes_like_eager(llama_ckpt: Path) -> None:
    engine = OfflineEngine.from_config(
        EngineConfig(model=str(llama_ckpt), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    )
    want = _greedy_tokens(engine, batch_size=3, steps=6)
    counter = CompileCounter()
    graphs = engine.core.runner.graphs
    torch._dynamo.reset()
    try:
        _, compiled = compiled_decode_forward(engine, batch_size=3, backend=counter)
        graphs.forward = compiled
        got = _greedy_tokens(engine, batch_size=3, steps=6)
    finally:
        del graphs.forward
        torch._dynamo.reset()
    assert got == want and all(len(t) >= 6 for t in got)
    # fullgraph=True would raise on a break; one frame compiled, reused by every decode step.
    assert counter.frame_count == 1 and counter.op_count > 0
