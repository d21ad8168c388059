"""One rule for reading a request's credential (issue 32, defect 9): headers that could name two
different keys (two Authorization headers, two x-api-key headers, or one of each that differ) give
no key at all, and api/access/keys.py's middleware refuses such a request with 400, so no reader (the key
check, the owner of a stored Response) can take another key than the rest."""

from __future__ import annotations

import pytest

from api.access.keys import credentials_conflict, token_from_headers

A, B = b"Bearer sk-a", b"Bearer sk-b"


@pytest.mark.parametrize(
    ("headers", "token"),
    [
        ([(b"authorization", A)], b"sk-a"),
        ([(b"authorization", A), (b"authorization", A)], b"sk-a"),  # the same key twice: one key
        ([(b"x-api-key", b"sk-a")], b"sk-a"),
        ([(b"authorization", A), (b"x-api-key", b"sk-a")], b"sk-a"),  # both kinds, one key
        ([(b"authorization", A), (b"authorization", B)], None),
        ([(b"authorization", B), (b"authorization", A)], None),
        ([(b"x-api-key", b"sk-a"), (b"x-api-key", b"sk-b")], None),
        ([(b"authorization", A), (b"x-api-key", b"sk-b")], None),
        ([(b"authorization", b"Basic c2stYQ=="), (b"x-api-key", b"sk-a")], None),  # not a bearer, and a key
    ],
)
def test_a_key_is_read_only_when_the_headers_name_exactly_one(
    headers: list[tuple[bytes, bytes]], token: bytes | None
) -> None:
    assert credentials_conflict(headers) == (token is None)
    assert token_from_headers(headers) == (token, True)


def test_no_credential_is_no_conflict() -> None:
    assert not credentials_conflict([(b"content-type", b"application/json")])
    assert token_from_headers([]) == (None, False)
