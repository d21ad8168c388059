"""The dashboard's "Usage by key" data source: the page reads GET /v1/usage with its own API key,
so each caller sees only what the server lets it see (an admin key every key, another key its
own, a keyless server the one `default` key), while /stats stays open and names no key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from api.app import ServerConfig, build_app
from engine.config import EngineConfig
from tests.server_utils import InProcessServer, in_process_server

KEYS = """
[[keys]]
name = "alice"
key = "sk-alice"

[[keys]]
name = "bob"
key = "sk-bob"

[[keys]]
name = "ops"
key = "sk-ops"
admin = true
"""


def no_engine(config: EngineConfig) -> Any:
    raise RuntimeError("no engine in this test")


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    config = ServerConfig(engine=EngineConfig(kv_cache_memory="32MiB", max_model_len=512), api_keys_file=str(keys))
    with in_process_server(config) as running:
        yield running


def usage(http: httpx.Client, key: str | None) -> httpx.Response:
    return http.get("/v1/usage", headers={"Authorization": f"Bearer {key}"} if key else {})


def rows(response: httpx.Response) -> dict[str, dict[str, Any]]:
    assert response.status_code == 200, response.text
    return {row["key"]: row for row in response.json()["data"]}


@pytest.mark.slow
def test_admin_sees_every_key_a_user_only_its_own_and_stats_names_none(team: InProcessServer) -> None:
    with httpx.Client(base_url=team.base_url, timeout=30) as http:
        before = rows(usage(http, "sk-ops"))
        chat = http.post(
            "/v1/chat/completions",
            headers={"Authorization": "Bearer sk-alice"},
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 6,
                "ignore_eos": True,
            },
        )
        assert chat.status_code == 200, chat.text
        everyone = rows(usage(http, "sk-ops"))
        alice, bob = rows(usage(http, "sk-alice")), rows(usage(http, "sk-bob"))
        refused = usage(http, None), usage(http, "sk-nobody")
        stats = http.get("/stats")  # open, as before: no key needed
    assert set(everyone) == {"alice", "bob", "ops"}
    assert everyone["alice"]["completion_tokens"] == before["alice"]["completion_tokens"] + 6
    assert (
        everyone["alice"]["prompt_tokens"] == before["alice"]["prompt_tokens"] + chat.json()["usage"]["prompt_tokens"]
    )
    assert everyone["alice"]["requests"] == before["alice"]["requests"] + 1
    assert everyone["alice"]["mean_ttft_seconds"] > 0
    assert everyone["bob"]["completion_tokens"] == 0 and everyone["bob"]["mean_ttft_seconds"] is None
    assert alice == {"alice": everyone["alice"]}  # a normal key: its own row, the same numbers
    assert list(bob) == ["bob"] and bob["bob"]["completion_tokens"] == 0
    assert [r.status_code for r in refused] == [401, 401]
    assert stats.status_code == 200 and stats.json()["tokens"]["generation_total"] >= 6
    assert not any(name in stats.text for name in ("alice", "bob", "ops", "default"))  # aggregate only


def test_a_keyless_server_shows_the_one_default_key() -> None:
    with TestClient(build_app(ServerConfig(engine=EngineConfig()), loader=no_engine)) as client:
        response = client.get("/v1/usage")
    assert response.status_code == 200
    body = response.json()
    assert body["key"] == "default"
    assert [(row["key"], row["requests"], row["completion_tokens"]) for row in body["data"]] == [("default", 0, 0)]
