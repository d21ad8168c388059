"""The engine-restart tests of tests/engine/test_engine_restart.py, on a server with the host KV tier on
(--kv-offloading-size): a killed or frozen engine is replaced, with the tier's host memory, and per-key
usage, rate limits and the cumulative counters carry on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engine.test_engine_restart import (  # noqa: F401  (collected here again, with this module's server)
    KEYS,
    STEP_TIMEOUT_S,
    test_a_frozen_engine_is_killed_by_the_watchdog_and_replaced,
    test_a_killed_engine_ends_every_stream_and_a_new_one_serves_what_follows,
    test_usage_and_rate_limits_of_a_key_survive_a_restart,
)
from tests.server_utils import RunningServer, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    s = start_server(
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--api-keys-file",
        str(keys),
        "--engine-step-timeout",
        str(STEP_TIMEOUT_S),
        "--kv-offloading-size",
        "0.05",
    )
    try:
        yield s
    finally:
        assert s.process.poll() is None, "the HTTP process exited"
        s.stop()
