"""Reading the credential of a request: `Authorization: Bearer <key>` and which paths need one.
`/health`, `/metrics` and `/version` stay open so probes and scrapers need no secret; the key
check itself (constant-time digests, limits) is api/access/keys.py's KeyMiddleware."""

from __future__ import annotations

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


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")
