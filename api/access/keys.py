"""API keys: who may call /v1/*, and who a request is for.

`KeyRing` holds the key records: from `--api-keys-file` (TOML, one `[[keys]]` table each), or the
one `--api-key` (named `default`), or none (everyone is `default`, unlimited). Secrets are kept as
SHA-256 digests only and never logged; names go to logs, metrics and /v1/usage. `reload()` (on
SIGHUP) swaps the records in one assignment: requests in flight keep the record they started with.

`resolve_key(headers, ring)` is the one function that maps a request's headers to its record,
for any route or middleware (`token_from_headers` reads `Authorization: Bearer` and Anthropic's
`x-api-key`); a request whose headers name two different keys is refused (`credentials_conflict`).
`KeyMiddleware` guards /v1/*, applies the key's limits (api/access/rate_limit.py) and leaves the key's record
in scope["state"]; `request_owner` makes the request's `Owner` (engine/core_types.py) from it, which
the handler passes to the engine for the scheduler's fair share.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from api.access.auth import _is_protected, bearer_token
from api.error_shape import shaped
from api.errors import error_response
from engine.front import Owner
from engine.front.errors import ConfigError

logger = logging.getLogger("fp4serve")
DEFAULT_NAME = "default"
API_KEY_ENV = "FP4SERVE_API_KEY"  # the single key's environment variable (api/cli.py)
KEY_STATE = "fp4serve.key"  # the request's KeyRecord, in scope["state"]
_FIELDS = {"name", "key", "key_sha256", "weight", "priority", "max_concurrent", "rpm", "tpm", "admin"}


@dataclass(frozen=True)
class KeyRecord:
    name: str
    digest: bytes = field(default=b"", repr=False)  # sha256 of the secret; b"": no secret (open server)
    weight: float = 1.0
    priority: int = 0
    max_concurrent: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    admin: bool = False

    @property
    def owner(self) -> Owner:
        return Owner(key=self.name, weight=self.weight, key_priority=self.priority)


OPEN = KeyRecord(DEFAULT_NAME, admin=True)  # no keys configured: one unlimited tenant


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def parse_keys_file(path: str | Path) -> tuple[KeyRecord, ...]:
    """The records of a keys file; ConfigError naming the file and the entry for a bad one."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--api-keys-file {path}: {e}") from None
    entries = doc.get("keys")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"--api-keys-file {path}: needs at least one [[keys]] table")
    records, names, digests = [], set(), set()
    for i, entry in enumerate(entries):
        where = f"--api-keys-file {path}: [[keys]] #{i + 1}"
        records.append(_record(entry, where))
        if records[-1].name in names:
            raise ConfigError(f"{where}: name {records[-1].name!r} is used twice")
        if records[-1].digest in digests:
            raise ConfigError(f"{where}: the same key is given twice")
        names.add(records[-1].name)
        digests.add(records[-1].digest)
    return tuple(records)


def _record(entry: Any, where: str) -> KeyRecord:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be a table")
    unknown = set(entry) - _FIELDS
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: needs a non-empty string `name`")
    where = f"{where} ({name})"
    if ("key" in entry) == ("key_sha256" in entry):
        raise ConfigError(f"{where}: give exactly one of `key` and `key_sha256`")
    if "key" in entry:
        if not isinstance(entry["key"], str) or not entry["key"]:
            raise ConfigError(f"{where}: `key` must be a non-empty string")
        digest = _digest(entry["key"].encode())
    else:
        try:
            digest = bytes.fromhex(entry["key_sha256"])
        except (TypeError, ValueError):
            digest = b""
        if len(digest) != 32:
            raise ConfigError(f"{where}: `key_sha256` must be 64 hex digits")
    weight = entry.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise ConfigError(f"{where}: `weight` must be a positive number")
    limits = {}
    for limit in ("max_concurrent", "rpm", "tpm"):
        value = entry.get(limit)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{where}: `{limit}` must be a positive integer")
        limits[limit] = value
    priority = entry.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigError(f"{where}: `priority` must be an integer")
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise ConfigError(f"{where}: `admin` must be true or false")
    return KeyRecord(name, digest, float(weight), priority, admin=admin, **limits)


class KeyRing:
    """The configured keys; `records` is replaced whole on reload (touched on the loop only)."""

    def __init__(self, api_key: str | None = None, keys_file: str | None = None) -> None:
        if api_key and keys_file:
            raise ConfigError(
                f"--api-keys-file and a single key (--api-key, --api-key-file or ${API_KEY_ENV}): give one of them"
            )
        self.keys_file = keys_file
        if keys_file:
            records: tuple[KeyRecord, ...] = parse_keys_file(keys_file)
        elif api_key:
            records = (KeyRecord(DEFAULT_NAME, _digest(api_key.encode()), admin=True),)
        else:
            records = ()
        self._set(records)

    def _set(self, records: Iterable[KeyRecord]) -> None:
        self.records = tuple(records)
        self._by_digest = {r.digest: r for r in self.records}

    @property
    def enabled(self) -> bool:
        return bool(self.records)

    def names(self) -> list[str]:
        return [r.name for r in self.records] or [DEFAULT_NAME]

    def reload(self) -> bool:
        """Re-read the keys file (SIGHUP). On an error the old keys stay and the error is logged."""
        if not self.keys_file:
            logger.info("SIGHUP: no --api-keys-file to reload")
            return False
        try:
            records = parse_keys_file(self.keys_file)
        except ConfigError as e:
            logger.error("keys not reloaded, the old ones stay: %s", e)
            return False
        self._set(records)
        logger.info("reloaded %d API keys from %s: %s", len(records), self.keys_file, ", ".join(self.names()))
        return True

    def lookup(self, token: bytes | None) -> KeyRecord | None:
        """The record for a presented secret, or None. With no keys configured: OPEN."""
        if not self.records:
            return OPEN
        if token is None:
            return None
        record = self._by_digest.get(_digest(token))
        # NOTE: the dict lookup is on a SHA-256 digest, which tells a timing attacker nothing about
        # the secret; compare_digest confirms the match in constant time all the same.
        if record is not None and hmac.compare_digest(record.digest, _digest(token)):
            return record
        return None


def credentials_conflict(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether the request names more than one credential: `Authorization` headers that differ,
    `x-api-key` headers that differ, or both kinds not carrying the same key. NOTE: the one rule for
    every reader of a credential (authentication, and the owner of stored Responses): a request
    that could be read as two keys is refused, so no two readers can ever see two keys."""
    authorization = {v for k, v in headers if k == b"authorization"}
    x_api_key = {v for k, v in headers if k == b"x-api-key"}
    if len(authorization) > 1 or len(x_api_key) > 1:
        return True
    tokens = {bearer_token(v) for v in authorization} | {v.strip() or None for v in x_api_key}
    return len(tokens) > 1


def token_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> tuple[bytes | None, bool]:
    """(the presented secret, whether any credential header was sent); no secret when the headers
    name several (credentials_conflict)."""
    headers = list(headers)
    if credentials_conflict(headers):
        return None, True
    authorization = next((v for k, v in headers if k == b"authorization"), None)
    if authorization is None:  # Anthropic clients (Claude Code) send `x-api-key: <key>` instead
        x_api_key = next((v for k, v in headers if k == b"x-api-key"), None)
        if x_api_key is not None:
            return x_api_key.strip() or None, True
    return bearer_token(authorization), authorization is not None


def resolve_key(headers: Iterable[tuple[bytes, bytes]], ring: KeyRing) -> KeyRecord | None:
    """A request's key record from its headers; None when the server wants a key it lacks."""
    token, _ = token_from_headers(headers)
    return ring.lookup(token)


def unauthorized_message(sent: bool) -> str:
    return "invalid API key" if sent else "missing API key: send 'Authorization: Bearer <key>'"


def unauthorized(sent: bool) -> Any:
    """The 401 in OpenAI's shape (KeyMiddleware re-shapes it for the route: api/error_shape.py)."""
    return error_response(
        401, unauthorized_message(sent), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
    )


def request_owner(scope: Scope, priority: int | None) -> Owner:
    """Who a request is for: its key's record (left by KeyMiddleware; OPEN where none is set) and
    the body's vLLM `priority`."""
    record: KeyRecord = scope.get("state", {}).get(KEY_STATE, OPEN)
    return replace(record.owner, priority=priority or 0)


class KeyMiddleware:
    """Pure ASGI: authenticates /v1/*, checks the key's limits (a refused request holds nothing),
    and runs the app with the key's record in scope["state"]."""

    def __init__(self, app: ASGIApp, ring: KeyRing, limiter: Any) -> None:
        self.app = app
        self.ring = ring
        self.limiter = limiter  # api/access/rate_limit.py RateLimiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_protected(scope["path"]) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if credentials_conflict(scope["headers"]):
            logger.warning(
                "refused %s %s: several different credentials (Authorization / x-api-key)",
                scope["method"],
                scope["path"],
            )
            refusal = error_response(
                400,
                "the request carries more than one API key (Authorization and x-api-key "
                "headers that differ); send exactly one",
                code="ambiguous_credentials",
            )
            await shaped(scope, refusal)(scope, receive, send)
            return
        token, sent = token_from_headers(scope["headers"])
        record = self.ring.lookup(token)
        if record is None:
            await shaped(scope, unauthorized(sent))(scope, receive, send)
            return
        scope.setdefault("state", {})[KEY_STATE] = record
        counts = scope["method"] == "POST"  # generation and other work; GET /v1/models, /v1/usage are free
        if not counts:
            await self.app(scope, receive, send)
            return
        refusal = self.limiter.acquire(record)
        if refusal is not None:
            # Anthropic's SDK reads its own shape (rate_limit_error) on /v1/messages
            await shaped(scope, refusal)(scope, receive, send)
            return
        headers = self.limiter.headers(record)

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start" and headers:
                message = {
                    **message,
                    "headers": [*message.get("headers", []), *((k.encode(), v.encode()) for k, v in headers.items())],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            self.limiter.release(record)
