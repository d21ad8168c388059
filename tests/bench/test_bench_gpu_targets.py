"""bench.gpu_targets: the device run's verdict read from gpu_check.sh's JSON reports."""

import json
from pathlib import Path

from bench.gpu_targets import evaluate, main


def step(fmt: str, batch: int, graph_ms: float | None, floor_ms: float, verify: float | None = None) -> dict:
    return {"format": fmt, "batch_size": batch, "graph_ms": graph_ms, "floor_ms": floor_ms, "verify_over_plain": verify}


def write(folder: Path, name: str, report: dict) -> None:
    (folder / name).write_text(json.dumps(report))


def verdicts(folder: Path) -> dict[str, str]:
    return {c.what: c.verdict for c in evaluate(folder)}


def test_reports_that_meet_every_target_pass(tmp_path: Path) -> None:
    write(
        tmp_path,
        "kernels.json",
        {"rows": [{"shape": "qwen3-8b qkv", "m": 1, "speedup": 2.7, "target": 2.5, "passed": True}]},
    )
    write(
        tmp_path,
        "bench-8b.json",
        {
            "steps": [
                step("bf16", 1, 6.0, 5.0, 1.1),
                step("nvfp4", 1, 2.5, 1.8, 1.1),
                step("bf16", 16, 8.0, 6.0),
                step("nvfp4", 16, 3.9, 2.5, 1.12),
            ],
            "throughput": [
                {"system": "fp4serve", "format": "bf16", "output_tokens_per_s": 5000.0},
                {"system": "fp4serve", "format": "nvfp4", "output_tokens_per_s": 7000.0},
            ],
        },
    )
    write(tmp_path, "bench-hybrid.json", {"steps": [step("nvfp4", b, 1.5, 1.0, 1.1) for b in (1, 16, 64)]})
    write(tmp_path, "bench-moe.json", {"steps": [step("nvfp4", 1, 2.0, 1.0)]})
    assert set(verdicts(tmp_path).values()) == {"pass"}


def test_a_slow_step_fails_and_a_missing_report_is_missing_never_pass(tmp_path: Path) -> None:
    write(
        tmp_path,
        "bench-8b.json",
        {"steps": [step("bf16", 1, 10.0, 5.0), step("nvfp4", 1, None, 1.8)], "throughput": []},
    )
    got = verdicts(tmp_path)
    assert got["bf16 batch 1 graph step / floor"] == "FAIL"  # 2.0 > 1.3
    assert got["nvfp4 batch 1 graph step / floor"] == "missing"  # no graph figure
    assert got["NVFP4 W4A16 sweep"] == "missing"
    assert got["MoE decode steps replayed from graphs"] == "missing"
    assert got["bf16 output tok/s"] == "missing"


def test_main_writes_the_verdict_beside_the_reports(tmp_path: Path, capsys) -> None:
    write(tmp_path, "bench-moe.json", {"steps": [step("nvfp4", 1, None, 1.0)]})
    assert main([str(tmp_path)]) == 0
    verdict = json.loads((tmp_path / "targets.json").read_text())
    moe = next(c for c in verdict["checks"] if c["what"] == "MoE decode steps replayed from graphs")
    assert moe["verdict"] == "FAIL"
    assert "targets:" in capsys.readouterr().out
