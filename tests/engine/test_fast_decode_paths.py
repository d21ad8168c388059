"""The leaner decode paths give the same numbers as the plain ones: the fused float32 RMSNorm,
RoPE tables gathered once per step, and decode attention without a gather/scatter of rows."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import ForwardBatch
from engine.models.layers import PositionedRotary, RMSNorm, RotaryEmbedding
from engine.weights.config.model_config import RopeConfig


@pytest.mark.parametrize("num_tokens", [1, 7, 32])
def test_float32_rms_norm_is_bit_identical_to_the_step_by_step_formula(num_tokens: int) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x = torch.randn(num_tokens, 576, generator=g) * 4
    x32 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)  # transformers' LlamaRMSNorm
    assert torch.equal(norm(x), norm.weight * x32)


@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_positioned_rotary_is_bit_identical_to_the_per_layer_rotary(rope_type: str) -> None:
    extra = {"factor": 8.0, "original_max_position_embeddings": 64} if rope_type == "llama3" else {}
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0, rope_type=rope_type, **extra), 64, 128, 256)
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 17, 200, 255])
    q, k = torch.randn(5, 9, 64, generator=g), torch.randn(5, 3, 64, generator=g)
    bound = rotary.at(positions, torch.float32)
    assert isinstance(bound, PositionedRotary)
    want_q, want_k = rotary(q, k, positions)
    got_q, got_k = bound(q, k, positions)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    qk = bound.rotate(torch.cat([q, k], dim=1))  # the decoder rotates q and k heads together
    assert torch.equal(qk[:, :9], want_q) and torch.equal(qk[:, 9:], want_k)


def _decode_batch(seq_lens: list[int], block_size: int, order: list[int]) -> ForwardBatch:
    """Decode rows (one new token each) for requests owning consecutive pages, listed in `order`."""
    pages, next_page = [], 0
    for n in seq_lens:
        num = -(-n // block_size)
        pages.append(list(range(next_page, next_page + num)))
        next_page += num
    kv_indptr, kv_indices = [0], []
    for i in order:
        kv_indices += pages[i]
        kv_indptr.append(len(kv_indices))
    slots = [pages[i][(seq_lens[i] - 1) // block_size] * block_size + (seq_lens[i] - 1) % block_size for i in order]
    num = len(order)
    return ForwardBatch(
        input_ids=torch.zeros(num, dtype=torch.int64),
        positions=torch.tensor([seq_lens[i] - 1 for i in order]),
        qo_indptr=torch.arange(num + 1, dtype=torch.int32),
        kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32),
        kv_indices=torch.tensor(kv_indices, dtype=torch.int32),
        kv_last_page_len=torch.tensor([(seq_lens[i] - 1) % block_size + 1 for i in order], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        logits_indices=torch.arange(num),
        query_lens=[1] * num,
        seq_lens=[seq_lens[i] for i in order],
        block_size=block_size,
        request_ids=[str(i) for i in order],
        sample_request_ids=[str(i) for i in order],
    )


# Up to 4 rows take the small-matmul path, more take SDPA.
@pytest.mark.parametrize("seq_lens", [[1], [37], [5, 16, 17, 40], [33, 33], [3, 9, 16, 17, 30, 47]])
def test_pure_decode_attention_equals_a_per_request_softmax(seq_lens: list[int]) -> None:
    bs, hq, hkv, d = 16, 6, 2, 8
    g = torch.Generator().manual_seed(len(seq_lens))
    cache = torch.randn(sum(-(-n // bs) for n in seq_lens) + 1, 2, bs, hkv, d, generator=g)
    backend = TorchAttentionBackend(hq, hkv, d, torch.device("cpu"))
    order = list(range(len(seq_lens)))
    backend.plan(_decode_batch(seq_lens, bs, order))
    q = torch.randn(len(seq_lens), hq, d, generator=g)
    k, v = torch.randn(len(seq_lens), hkv, d, generator=g), torch.randn(len(seq_lens), hkv, d, generator=g)
    out = backend.forward(q, k, v, cache)
    first_page = 0
    for i, n in enumerate(seq_lens):
        pages = cache[first_page : first_page + -(-n // bs)]  # this request's pages, new K/V written
        first_page += pages.shape[0]
        keys, values = pages[:, 0].reshape(-1, hkv, d)[:n], pages[:, 1].reshape(-1, hkv, d)[:n]
        assert torch.equal(keys[-1], k[i]) and torch.equal(values[-1], v[i])
        for h in range(hq):
            kv_head = h // (hq // hkv)
            weights = (keys[:, kv_head] @ q[i, h] * d**-0.5).softmax(0)
            torch.testing.assert_close(out[i, h], weights @ values[:, kv_head], rtol=1e-5, atol=1e-6)
