"""The bounded in-memory store behind `store` / `previous_response_id` and
GET / DELETE /v1/responses/{id}: least recently used first out, and every entry visible only to
the API key that created it (a digest of the key, never the key). Lives in the HTTP process and
is lost on restart."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_RESPONSES_STORE_SIZE = 1024


@dataclass(frozen=True)
class StoredResponse:
    owner: bytes  # sha256 of the API key that created it (of b"" without one)
    body: dict[str, Any]  # the response object, as GET returns it
    messages: list[dict[str, Any]]  # the whole conversation in chat shape, this turn's output included


def owner_of(api_key: bytes | None) -> bytes:
    return hashlib.sha256(api_key or b"").digest()


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        assert capacity >= 0, capacity
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, owner: bytes) -> StoredResponse | None:
        """The entry, or None when it does not exist or another key created it (the same answer,
        so that ids cannot be probed)."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: bytes) -> bool:
        if self.get(response_id, owner) is None:
            return False
        del self._entries[response_id]
        return True
