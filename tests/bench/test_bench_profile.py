"""`python -m bench profile` on a tiny Llama: every kind of work the decoder does is timed, the
hooks come off afterwards, and the command writes its JSON."""

from __future__ import annotations

from pathlib import Path

import orjson

from bench.__main__ import main
from bench.profile import format_profile, profile_decode
from engine.config import EngineConfig
from engine.front.offline import OfflineEngine


def test_profile_times_each_kind_and_leaves_the_engine_clean(llama_ckpt: Path) -> None:
    engine = OfflineEngine.from_config(EngineConfig(model=str(llama_ckpt), dtype="float32", kv_cache_memory="16MiB"))
    prof, table = profile_decode(engine, batch_size=3, prompt_len=5, num_steps=2)
    assert table is None and prof.batch_size == 3 and prof.num_steps == 2
    for kind in ("matmuls", "lm_head", "attention", "norms", "activation", "residuals", "sampling"):
        assert prof.kind_ms[kind] > 0, kind
    assert sum(prof.kind_ms.values()) <= prof.hooked_step_ms * 1.01
    assert prof.step_ms > 0 and prof.cpu_ms > 0
    runner = engine.core.runner
    assert "forward" not in vars(runner.backend) and "sample" not in vars(runner.sampler), "hooks left behind"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())
    assert not engine.has_unfinished()
    assert "batch 3" in format_profile([prof], "tiny")


def test_profile_command_writes_one_profile_per_batch_size(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert (
        main(
            [
                "profile",
                "--model",
                str(llama_ckpt),
                "--batch-size",
                "1,2",
                "--steps",
                "2",
                "--input-len",
                "4",
                "--kv-cache-memory",
                "16MiB",
                "--max-model-len",
                "256",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = orjson.loads(out.read_bytes())
    assert [p["batch_size"] for p in doc["profiles"]] == [1, 2]
    assert all(p["kind_ms"]["matmuls"] > 0 for p in doc["profiles"])
