"""The CPU decode step's streamed weights moved into one huge-page buffer (engine/host/huge_pages.py):
the same values, in read order, one buffer; nothing moves where THP is off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.host import huge_pages
from engine.host.huge_pages import HUGE_PAGE, move_to_huge_pages, thp_mode
from engine.weights.formats.int4_linear import Int4Linear, cpu_streamed_weights
from engine.weights.formats.int8_linear import Int8Linear


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(
            Int4Linear.from_float(torch.randn(64, 96, generator=g), None, own_kernel=False) for _ in range(3)
        )
        self.lm_head = Int8Linear.from_float(torch.randn(500, 64, generator=g), None, torch.bfloat16)


def test_thp_mode_reads_the_bracketed_setting(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert thp_mode(setting) == "madvise"
    setting.write_text("[never] madvise always\n")
    assert thp_mode(setting) == "never"
    assert thp_mode(tmp_path / "missing") is None


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="this kernel has transparent huge pages off")
def test_streamed_weights_move_into_one_advised_buffer_in_read_order() -> None:
    model = Tiny()
    x = torch.randn(3, 96).to(torch.bfloat16)
    h = torch.randn(2, 64).to(torch.bfloat16)
    before = [layer(x) for layer in model.layers], model.lm_head(h)
    values = [getattr(m, name).clone() for m, name in cpu_streamed_weights(model)]
    moved = move_to_huge_pages(cpu_streamed_weights(model))
    tensors = [getattr(m, name) for m, name in cpu_streamed_weights(model)]
    assert moved >= sum(t.nbytes for t in tensors) and len(tensors) == 7  # 3 x (codes, scales) + the head
    assert all(torch.equal(a, b) for a, b in zip(tensors, values))
    ptrs = [t.data_ptr() for t in tensors]
    assert ptrs == sorted(ptrs) and ptrs[0] % HUGE_PAGE == 0 and ptrs[-1] + tensors[-1].nbytes - ptrs[0] <= moved
    assert all(t.untyped_storage().data_ptr() == tensors[0].untyped_storage().data_ptr() for t in tensors)
    after = [layer(x) for layer in model.layers], model.lm_head(h)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and torch.equal(before[1], after[1])


def test_nothing_moves_where_thp_is_off_or_madvise_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Tiny()
    ptrs = [getattr(m, name).data_ptr() for m, name in cpu_streamed_weights(model)]
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert move_to_huge_pages(cpu_streamed_weights(model)) == 0
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "_madvise_huge", lambda address, length: False)
    assert move_to_huge_pages(cpu_streamed_weights(model)) == 0
    assert [getattr(m, name).data_ptr() for m, name in cpu_streamed_weights(model)] == ptrs
