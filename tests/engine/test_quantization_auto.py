"""`--quantization auto` on CPU picks, for the built-in model, the format whose decode-step linears
ran fastest at one row as measured at start-up (times injected through the timer seam, so these
run alike on any CPU); the figures are cached per CPU, torch and shapes, so a second start does not
measure again; an explicit scheme is never measured or overridden; and the real measurement runs
on a tiny model's shapes and says what it found."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from engine.host.format_timing import (
    DENSE,
    FEW_ROWS,
    FormatTimes,
    FormatTiming,
    LinearShapes,
    measured_formats,
    time_formats,
)
from engine.weights.config.model_config import ModelConfig
from engine.weights.dtype_policy import AUTO_CANDIDATES, cpu_has_native_bf16, resolve_quantization
from engine.weights.model_source import DEFAULT_MODEL_ENV

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SMOLLM2 = LinearShapes(((960, 576), (576, 576), (3072, 576), (576, 1536)), 30, (49152, 576))


class CountingTimer:
    """Returns fixed times (ms at one row by candidate) and counts its calls."""

    def __init__(self, one_row_ms: dict[str, float]) -> None:
        self.one_row_ms = one_row_ms
        self.calls: list[tuple[LinearShapes, tuple[str, ...], torch.dtype]] = []

    def __call__(self, shapes: LinearShapes, candidates: tuple[str, ...], dense_dtype: torch.dtype) -> FormatTimes:
        self.calls.append((shapes, candidates, dense_dtype))
        return {k: FormatTiming(self.one_row_ms[k], 2 * self.one_row_ms[k]) for k in candidates}


@pytest.fixture(autouse=True)
def builtin_model_and_fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv(DEFAULT_MODEL_ENV, raising=False)  # what users get without --model: SmolLM2
    monkeypatch.setenv("FP4SERVE_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("one_row_ms", "expected", "said"),
    [
        ({"int4": 6.2, "int8": 4.1, DENSE: 5.5}, "int8", "int8 for the built-in"),
        ({"int4": 3.9, "int8": 4.1, DENSE: 5.5}, "int4", "int4 for the built-in"),
        ({"int4": 6.2, "int8": 4.1, DENSE: 3.0}, None, "for the built-in"),
    ],
)
def test_auto_picks_the_format_measured_fastest_at_one_row(
    one_row_ms: dict[str, float], expected: str | None, said: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    timer = CountingTimer(one_row_ms)
    with caplog.at_level(logging.INFO, logger="fp4serve.runner"):
        assert resolve_quantization("auto", None, CPU, "auto", SMOLLM2, timer) == expected
    assert len(timer.calls) == 1 and timer.calls[0][:2] == (SMOLLM2, AUTO_CANDIDATES)
    fastest = min(one_row_ms.values())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("quantization auto:"))
    threads = torch.get_num_threads()
    assert said in line and f"{threads} thread{'s' * (threads != 1)} at 1 row: {fastest:.2f} ms vs " in line
    assert f"at {FEW_ROWS} rows:" in line
    assert "measured on this CPU" in line and f"cached in {tmp_path / 'quantization-auto'}" in line


def test_the_dense_candidate_is_the_dtype_the_model_would_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.weights.dtype_policy as policy

    timer = CountingTimer({"int4": 1.0, "int8": 2.0, DENSE: 3.0})
    monkeypatch.setattr(policy, "cpu_has_native_bf16", lambda: False)
    resolve_quantization("auto", None, CPU, "auto", SMOLLM2, timer)
    resolve_quantization("auto", None, CPU, "bfloat16", SMOLLM2, timer)  # asked for: bf16 even when emulated
    assert [dense for _, _, dense in timer.calls] == [torch.float32, torch.bfloat16]


def test_a_second_start_reads_the_cached_times_instead_of_measuring(caplog: pytest.LogCaptureFixture) -> None:
    timer = CountingTimer({"int4": 6.2, "int8": 4.1, DENSE: 5.5})
    assert resolve_quantization("auto", None, CPU, "auto", SMOLLM2, timer) == "int8"
    with caplog.at_level(logging.INFO, logger="fp4serve.runner"):
        # A start that would measure otherwise still reads the first verdict's figures.
        assert (
            resolve_quantization("auto", None, CPU, "auto", SMOLLM2, CountingTimer({"int4": 1, "int8": 9, DENSE: 9}))
            == "int8"
        )
    assert len(timer.calls) == 1
    assert "measured on this CPU at 20" in caplog.text and ", read from " in caplog.text
    assert "measured on this CPU in" not in caplog.text
    other = LinearShapes(((96, 64), (64, 64), (256, 64), (64, 128)), 2, (1000, 64))
    resolve_quantization("auto", None, CPU, "auto", other, timer)  # other shapes: their own measurement
    assert len(timer.calls) == 2


def test_an_explicit_scheme_or_another_model_is_never_measured() -> None:
    timer = CountingTimer({"int4": 9.0, "int8": 1.0, DENSE: 9.0})
    assert resolve_quantization("int4", None, CPU, "auto", SMOLLM2, timer) == "int4"
    assert resolve_quantization("int8", None, CPU, "auto", SMOLLM2, timer) == "int8"
    assert resolve_quantization("none", None, CPU, "auto", SMOLLM2, timer) is None
    assert resolve_quantization("auto", None, CUDA, "auto", SMOLLM2, timer) is None
    assert resolve_quantization("auto", None, CPU, "float32", SMOLLM2, timer) is None  # int4/int8 run bf16
    assert resolve_quantization("auto", "/models/SmolLM2-135M-Instruct", CPU, "auto", SMOLLM2, timer) is None
    assert timer.calls == []


def test_the_real_measurement_times_every_candidate_on_a_tiny_model(
    qwen3_ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shapes = LinearShapes.of(ModelConfig.from_checkpoint(qwen3_ckpt))
    times = time_formats(shapes, AUTO_CANDIDATES, torch.bfloat16, budget_s=0.2)
    assert set(times) == set(AUTO_CANDIDATES)
    for timing in times.values():
        assert 0 < timing.one_row_ms < math.inf and 0 < timing.few_rows_ms < math.inf
    with caplog.at_level(logging.INFO, logger="fp4serve.runner"):
        chosen = resolve_quantization("auto", None, CPU, "auto", shapes)
    assert "measured on this CPU in" in caplog.text

    def no_second_measurement(*args: object) -> FormatTimes:
        raise AssertionError("the figures were cached")

    dense = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    cached = measured_formats(shapes, AUTO_CANDIDATES, dense, no_second_measurement)
    fastest = min(AUTO_CANDIDATES, key=lambda k: cached.times[k].one_row_ms)
    assert cached.from_cache and chosen == (None if fastest == DENSE else fastest)


def test_an_unreadable_cached_file_is_measured_and_cached_again() -> None:
    timer = CountingTimer({"int4": 6.2, "int8": 4.1, DENSE: 5.5})
    first = measured_formats(SMOLLM2, AUTO_CANDIDATES, torch.bfloat16, timer)
    times_file = first.folder / "format_times.json"
    times_file.write_text("{" + " " * (times_file.stat().st_size - 1))  # same size, not JSON
    again = measured_formats(SMOLLM2, AUTO_CANDIDATES, torch.bfloat16, timer)
    assert not again.from_cache and again.times == first.times and len(timer.calls) == 2
    assert measured_formats(SMOLLM2, AUTO_CANDIDATES, torch.bfloat16, timer).from_cache  # cached again
    assert len(timer.calls) == 2
