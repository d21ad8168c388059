"""Keys files (api/access/keys.py) and the rate limiter's windows (api/access/rate_limit.py), without a server."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import pytest

from api.access.keys import KeyRecord, KeyRing, parse_keys_file
from api.access.rate_limit import RateLimiter, format_reset
from engine.errors import ConfigError


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return str(path)


def test_keys_file_records_and_lookup(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"sk-b").hexdigest()
    ring = KeyRing(
        keys_file=write(
            tmp_path,
            f'''
[[keys]]
name = "a"
key = "sk-a"
weight = 2
priority = -1
rpm = 5
[[keys]]
name = "b"
key_sha256 = "{digest}"
admin = true
''',
        )
    )
    a = ring.lookup(b"sk-a")
    assert a is not None and (a.name, a.weight, a.priority, a.rpm, a.admin) == ("a", 2.0, -1, 5, False)
    assert ring.lookup(b"sk-b").name == "b" and ring.lookup(b"sk-b").admin
    assert ring.lookup(b"sk-c") is None and ring.lookup(None) is None
    assert "sk-a" not in repr(a)


def test_single_key_is_default_and_no_key_is_open() -> None:
    assert KeyRing(api_key="sk").lookup(b"sk").name == "default"
    assert KeyRing().lookup(None).name == "default"


@pytest.mark.parametrize(
    "body, why",
    [
        ('[[keys]]\nname = "a"\n', "exactly one of"),
        ('[[keys]]\nname = "a"\nkey = "x"\nkey_sha256 = "00"\n', "exactly one of"),
        ('[[keys]]\nname = "a"\nkey_sha256 = "zz"\n', "64 hex digits"),
        ('[[keys]]\nname = "a"\nkey = "x"\nweight = 0\n', "weight"),
        ('[[keys]]\nname = "a"\nkey = "x"\nrpm = -1\n', "rpm"),
        ('[[keys]]\nname = "a"\nkey = "x"\nrmp = 1\n', "unknown field"),
        ('[[keys]]\nname = "a"\nkey = "x"\n[[keys]]\nname = "a"\nkey = "y"\n', "used twice"),
        ('[[keys]]\nname = "a"\nkey = "x"\n[[keys]]\nname = "b"\nkey = "x"\n', "same key"),
        ("keys = 1\n", "at least one"),
        ("[[keys]\n", "keys.toml"),
    ],
)
def test_bad_keys_files_name_the_problem(tmp_path: Path, body: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_keys_file(write(tmp_path, body))


def test_reload_keeps_the_old_keys_on_error(tmp_path: Path) -> None:
    path = write(tmp_path, '[[keys]]\nname = "a"\nkey = "x"\n')
    ring = KeyRing(keys_file=path)
    Path(path).write_text('[[keys]]\nname = "a"\n')
    assert not ring.reload() and ring.lookup(b"x").name == "a"
    Path(path).write_text('[[keys]]\nname = "b"\nkey = "y"\n')
    assert ring.reload() and ring.lookup(b"x") is None and ring.lookup(b"y").name == "b"


def test_windows_slide_and_refusals_hold_nothing() -> None:
    now = [0.0]
    used = {"a": 0}
    limiter = RateLimiter(lambda name: used[name], clock=lambda: now[0])
    key = KeyRecord("a", rpm=2, tpm=100, max_concurrent=5)
    assert limiter.acquire(key) is None and limiter.acquire(key) is None
    refused = limiter.acquire(key)
    assert refused is not None and refused.status_code == 429
    assert orjson.loads(refused.body)["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["retry-after"] == "60" and refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert limiter.in_flight["a"] == 2  # the refused one holds no slot
    now[0] = 30.0
    used["a"] = 150  # tokens used since the window began
    limiter.release(key)
    limiter.release(key)
    now[0] = 61.0  # the two requests left the request window; the tokens have not left theirs
    refused = limiter.acquire(key)
    assert refused is not None and orjson.loads(refused.body)["error"]["type"] == "tokens"
    now[0] = 95.0  # the 150 tokens were counted at 30 s: gone from the window at 90 s
    assert limiter.acquire(key) is None


def test_format_reset() -> None:
    assert (format_reset(0.02), format_reset(1.2), format_reset(360)) == ("20ms", "2s", "6m0s")


def test_the_body_priority_joins_the_key_owner() -> None:
    from api.access.keys import KEY_STATE, request_owner
    from engine.core_types import Owner

    scope = {"state": {KEY_STATE: KeyRecord("a", weight=2.0, priority=1)}}
    assert request_owner(scope, -3) == Owner(key="a", weight=2.0, key_priority=1, priority=-3)
    assert request_owner(scope, None) == Owner(key="a", weight=2.0, key_priority=1, priority=0)
    assert request_owner({}, 5) == Owner(key="default", priority=5)  # no key configured: everyone is `default`
