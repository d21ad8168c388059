"""`bench context` / `bench tiny-model`: the random checkpoints load in the engine and the curve has
one point per window of decode steps, ending at the requested context."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.context_curve import format_curves, run_context_curve, write_tiny_model
from engine.config import EngineConfig
from engine.front.offline import OfflineEngine


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_curve_has_a_point_per_window_up_to_the_context(tmp_path: Path, kind: str) -> None:
    path = write_tiny_model(tmp_path / kind, kind, hidden=64, num_layers=4)
    engine = OfflineEngine.from_config(
        EngineConfig(model=str(path), dtype="float32", max_num_seqs=2, kv_cache_memory="4MiB", max_model_len=64)
    )
    assert (engine.core.model_config.hybrid is not None) == (kind == "hybrid")
    points = run_context_curve(engine, batch_size=2, context=40, window=8)
    assert [p.context for p in points] == [25, 33, 40]  # 17 tokens after the prefill step, +1 per step
    assert all(p.forward_ms > 0 and p.step_ms >= p.forward_ms for p in points)
    assert not engine.has_unfinished()
    table = format_curves({"a": points, "b": points})
    assert table.splitlines()[-1].split() == [
        "40",
        f"{points[-1].forward_ms:.2f}",
        f"{points[-1].forward_ms:.2f}",
        "1.00",
    ]
