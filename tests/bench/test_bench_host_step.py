"""`python -m bench host-step` runs end to end on tiny settings and reports every phase, for both
modes; its figures are measurements, so nothing here asserts a time."""

from __future__ import annotations

import json
from pathlib import Path

from bench.__main__ import main
from bench.host_step import PHASES


def test_host_step_reports_each_batch_forward_time_and_mode(tmp_path: Path, capsys: object) -> None:
    out = tmp_path / "host.json"
    assert (
        main(
            [
                "host-step",
                "--batch-size",
                "1,3",
                "--forward-ms",
                "0,1",
                "--steps",
                "3",
                "--warmup",
                "1",
                "--input-len",
                "5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    runs = [(r["batch_size"], r["forward_ms"], r["async_scheduling"]) for r in doc["results"]]
    assert runs == [(b, f, a) for b in (1, 3) for f in (0.0, 1.0) for a in (False, True)]
    for r in doc["results"]:
        assert set(r["phases_ms"]) == set(PHASES) and r["num_steps"] == 3
        assert r["step_ms"] > 0 and r["exposed_ms"] >= 0
    table = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "exposed" in table and len(table.strip().splitlines()) == 2 + len(runs)
