"""`bench agent-replay --sessions` (bench/agent_sessions.py) against a real in-process server with the
host KV tier on and a device cache smaller than the sessions' histories: sessions take turns
round-robin, each resending its own history, later turns come back cached, and the summary is
computed from the samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.app import ServerConfig
from bench.agent_sessions import replay_sessions, session_summary
from bench.context_curve import write_tiny_model
from engine.config import EngineConfig
from tests.server_utils import in_process_server

pytestmark = pytest.mark.slow


def test_sessions_take_turns_round_robin_and_later_turns_come_back_from_the_host(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny", "dense", hidden=64, num_layers=2)
    # 8 pages of 16 tokens (1 KiB a token): about one of the three histories.
    engine = EngineConfig(
        model=str(model),
        served_model_name="tiny",
        dtype="float32",
        kv_cache_memory="128KiB",
        engine_process=False,
        kv_offloading_size=0.01,
    )
    with in_process_server(ServerConfig(engine=engine)) as server:
        results = replay_sessions(
            {"host": server.base_url}, "tiny", sessions=3, system_len=60, turns=2, turn_len=10, output_len=4, seed=0
        )
    samples = results["host"]
    assert [(s.index, s.session) for s in samples] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    first, later = samples[:3], samples[3:]
    assert all(s.cached_tokens == 0 for s in first)
    assert all(
        b.prompt_tokens > a.prompt_tokens and b.cached_tokens >= a.prompt_tokens - 16 for a, b in zip(first, later)
    )
    summary = session_summary(samples)
    assert summary["cached_share_later"] == sum(s.cached_tokens for s in later) / sum(s.prompt_tokens for s in later)
    assert summary["mean_ttft_first_s"] > 0 and summary["mean_ttft_later_s"] > 0
