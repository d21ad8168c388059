"""vLLM's block hashes for the KV events, beside the scheduler's own (scheduler/block_manager.py).

The scheduler keys its prefix cache by a blake2b chain over int64 token bytes: fast, and private.
A router compares an event's hashes with hashes of its own or with later events' parents, so the
events carry vLLM's scheme instead, the one `--prefix-caching-hash-algo sha256_cbor` gives:

    hash_0 = sha256(cbor([NONE_HASH, [t_0 .. t_15], null]))       NONE_HASH = sha256(cbor(PYTHONHASHSEED))
    hash_i = sha256(cbor([hash_{i-1}, [tokens of page i], null]))   (32 random bytes without the variable)

and on the wire the low 64 bits of each, big-endian (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES,
on by default). Computed only with events on, once per page as it enters the cache.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import cbor2

from scheduler.request import Request

_LOW_64 = (1 << 64) - 1


def sha256_cbor(value: Any) -> bytes:
    """vLLM's `sha256_cbor`: SHA-256 of canonical CBOR."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def to_wire(block_hash: bytes) -> int:
    """The 64-bit integer a 32-byte hash travels as (vLLM's `maybe_convert_block_hash`)."""
    return int.from_bytes(block_hash, "big") & _LOW_64


class ExternalBlockHashes:
    """vLLM's 32-byte hash of every page the prefix cache holds, by the scheduler's own hash.
    Entries come with BlockStored and go with BlockRemoved / AllBlocksCleared, so the map never
    outgrows the cache."""

    def __init__(self, block_size: int, hash_seed: str | None = None) -> None:
        self.block_size = block_size
        self.hash_seed = os.environ.get("PYTHONHASHSEED") if hash_seed is None else hash_seed
        # vLLM's NONE_HASH: the parent of every first page.
        self.none_hash = sha256_cbor(self.hash_seed) if self.hash_seed is not None else os.urandom(32)
        self._by_internal: dict[bytes, bytes] = {}
        self._offloaded: dict[bytes, bytes] = {}  # the same, for the pages the host tier holds

    def describe(self) -> str:
        seed = (
            f"PYTHONHASHSEED={self.hash_seed}"
            if self.hash_seed is not None
            else ("a random seed (set PYTHONHASHSEED to make them reproducible across replicas and routers)")
        )
        return f"vLLM's sha256_cbor chain, low 64 bits, seeded by {seed}"

    def __len__(self) -> int:
        return len(self._by_internal)

    def parent_of(self, request: Request, index: int) -> int | None:
        """The wire hash of page `index - 1` of the request, None for its first page."""
        return to_wire(self._full(request, index - 1)) if index > 0 else None

    def store(self, request: Request, indices: list[int]) -> list[int]:
        """Hash consecutive pages of the request entering the cache; their wire hashes."""
        parent = self._full(request, indices[0] - 1) if indices[0] > 0 else self.none_hash
        wire = []
        for i in indices:
            parent = self._chain(parent, request, i)
            self._by_internal[request.block_hashes[i]] = parent
            wire.append(to_wire(parent))
        return wire

    def remove(self, internal: bytes) -> int:
        external = self._by_internal.pop(internal, None)
        assert external is not None, "a page left the prefix cache that no BlockStored announced"
        return to_wire(external)

    def offload(self, internal: bytes) -> int:
        """A cached page copied to the host tier (still cached on the device, so its hash is known)."""
        external = self._by_internal.get(internal)
        assert external is not None, "the host tier took a page that no BlockStored announced"
        self._offloaded[internal] = external
        return to_wire(external)

    def drop_offloaded(self, internal: bytes) -> int:
        external = self._offloaded.pop(internal, None)
        assert external is not None, "the host tier dropped a page it never announced"
        return to_wire(external)

    def clear(self) -> None:
        self._by_internal.clear()
        self._offloaded.clear()

    def _chain(self, parent: bytes, request: Request, index: int) -> bytes:
        bs = self.block_size
        return sha256_cbor((parent, tuple(request.token_slice(index * bs, (index + 1) * bs)), None))

    def _full(self, request: Request, index: int) -> bytes:
        """Page `index`'s 32-byte hash. Known while a page with that content is cached; else (its
        cached twin was evicted, the request still holds its own unregistered copy) recomputed from
        the nearest cached ancestor: rare, and not kept, since no page holds it in the cache."""
        known = self._by_internal.get(request.block_hashes[index])
        if known is not None:
            return known
        start = index
        while start > 0 and request.block_hashes[start - 1] not in self._by_internal:
            start -= 1
        parent = self._by_internal[request.block_hashes[start - 1]] if start > 0 else self.none_hash
        for i in range(start, index + 1):
            parent = self._chain(parent, request, i)
        return parent
