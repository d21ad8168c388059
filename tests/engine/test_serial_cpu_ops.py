"""Small decode batches run their KV write and attention, and decode-sized batches their MLP
activation, on one CPU thread (no OpenMP wake-ups per layer); the thread count comes back
afterwards, and the numbers are the same."""

from __future__ import annotations

import pytest
import torch

import engine.attention.torch_ref as torch_ref
from engine.attention.torch_ref import TorchAttentionBackend
from engine.host.cpu_threads import serial_cpu_ops
from tests.engine.test_fast_decode_paths import _decode_batch


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_serial_cpu_ops_runs_on_one_thread_and_restores_the_count(two_threads: None) -> None:
    with serial_cpu_ops():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError), serial_cpu_ops():
        raise ValueError("an op failed")
    assert torch.get_num_threads() == 2  # restored on the error path too
    with serial_cpu_ops(enabled=False):
        assert torch.get_num_threads() == 2


def _run(
    seq_lens: list[int], monkeypatch: pytest.MonkeyPatch, serial: bool
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The backend's output, the cache after its KV write, and the thread counts its decode
    attention ran with."""
    monkeypatch.setattr(torch_ref, "SERIAL_SMALL_DECODE", serial)
    bs, hq, hkv, d = 16, 6, 2, 8
    g = torch.Generator().manual_seed(len(seq_lens))
    cache = torch.randn(sum(-(-n // bs) for n in seq_lens) + 1, 2, bs, hkv, d, generator=g)
    backend = TorchAttentionBackend(hq, hkv, d, torch.device("cpu"))
    backend.plan(_decode_batch(seq_lens, bs, list(range(len(seq_lens)))))
    seen: list[int] = []
    inner = backend._decode_attention

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return inner(*args, **kwargs)

    monkeypatch.setattr(backend, "_decode_attention", spy)
    q = torch.randn(len(seq_lens), hq, d, generator=g)
    k, v = torch.randn(len(seq_lens), hkv, d, generator=g), torch.randn(len(seq_lens), hkv, d, generator=g)
    return backend.forward(q, k, v, cache), cache, seen


@pytest.mark.parametrize("seq_lens", [[1], [37], [5, 16, 17, 40]])
def test_a_small_decode_batch_attends_on_one_thread_with_the_same_result(
    seq_lens: list[int], two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, cache, seen = _run(seq_lens, monkeypatch, serial=True)
    assert seen == [1] and torch.get_num_threads() == 2
    want_out, want_cache, seen_parallel = _run(seq_lens, monkeypatch, serial=False)
    assert seen_parallel == [2]
    assert torch.equal(out, want_out) and torch.equal(cache, want_cache)


def test_a_large_decode_batch_keeps_every_thread(two_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, seen = _run([3, 9, 16, 17, 30, 47], monkeypatch, serial=True)  # > 4 rows: SDPA over both threads
    assert seen == [2]


@pytest.mark.parametrize(("num_tokens", "threads"), [(1, 1), (64, 1), (65, 2)])
def test_the_mlp_activation_of_a_decode_sized_batch_runs_on_one_thread(
    num_tokens: int, threads: int, two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    import torch.nn.functional as F

    from engine.models import decoder

    seen: list[int] = []

    class SpyF:  # torch.nn.functional as decoder.py sees it, counting threads at silu
        def __getattr__(self, name: str):
            return getattr(F, name)

        def silu(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return F.silu(x)

    monkeypatch.setattr(decoder, "F", SpyF())
    g = torch.Generator().manual_seed(num_tokens)
    mlp = decoder.MLP(SimpleNamespace(hidden_size=8, intermediate_size=16, mlp_bias=False))
    mlp.gate_up_proj.weight.data = torch.randn(32, 8, generator=g)
    mlp.down_proj.weight.data = torch.randn(8, 16, generator=g)
    x = torch.randn(num_tokens, 8, generator=g)
    gate, up = (x @ mlp.gate_up_proj.weight.T).chunk(2, dim=-1)
    assert torch.equal(mlp(x), (F.silu(gate) * up) @ mlp.down_proj.weight.T)
    assert seen == [threads] and torch.get_num_threads() == 2
