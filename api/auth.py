"""API-key check for `/v1/*`: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`),
compared in constant time.
`/health`, `/metrics` and `/version` stay open so probes and scrapers need no secret."""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from api.anthropic_errors import anthropic_error_response, is_messages_path
from api.errors import error_response

PROTECTED_PREFIX = "/v1"


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


class APIKeyMiddleware:
    """Pure ASGI middleware (no body buffering, so streaming responses pass straight through)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        assert api_key, "APIKeyMiddleware needs a non-empty key"
        self.app = app
        self._key_digest = _digest(api_key.encode())

    def is_authorized(self, authorization: bytes | None) -> bool:
        token = bearer_token(authorization)
        # NOTE: compare_digest takes the same time whatever prefix matches, but may leak a length
        # difference; comparing fixed-size digests leaks neither. Comparing a dummy for a missing
        # token keeps the two failure paths alike too.
        return hmac.compare_digest(_digest(token or b""), self._key_digest) and token is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_protected(scope["path"]) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        x_api_key = next((v for k, v in scope["headers"] if k == b"x-api-key"), None)
        if authorization is None and x_api_key is not None:
            authorization = b"Bearer " + x_api_key  # Anthropic clients (Claude Code) send this header
        if self.is_authorized(authorization):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send 'Authorization: Bearer <key>'" if authorization is None else "invalid API key"
        if is_messages_path(scope["path"]):
            response = anthropic_error_response(401, message, headers={"WWW-Authenticate": "Bearer"})
        else:
            response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")
