"""vLLM's `--kv-events-config`: `KVEventsConfig`, and the endpoint each data-parallel core
publishes on (engine/cache_events/kv_events.py sends the events)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from engine.errors import ConfigError


def offset_endpoint(endpoint: str, rank: int) -> str:
    """A ZMQ endpoint moved to data-parallel rank `rank` (KVEventsConfig.for_rank)."""
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ConfigError(f"--kv-events-config: {endpoint} has no port to offset by the data-parallel rank")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (its `KVEventsConfig` fields and defaults): KV-cache events
    published over ZMQ for routers that track what each replica caches (engine/cache_events/kv_events.py)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; None: "zmq" when enabled, as vLLM derives it
    endpoint: str = "tcp://*:5557"  # bound when it holds "*", "::", ipc:// or inproc://, else connected to
    replay_endpoint: str | None = None  # a ROUTER socket that resends buffered batches from a sequence number
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ high-water mark of the PUB socket
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in (None, "zmq", "null"):
            raise ConfigError(f"--kv-events-config: publisher '{self.publisher}' is not one of zmq, null")
        for name in ("buffer_steps", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--kv-events-config: {name} must be positive, got {getattr(self, name)}")
        if self.hwm < 0:
            raise ConfigError(f"--kv-events-config: hwm must not be negative, got {self.hwm}")

    @property
    def enabled(self) -> bool:
        """Events are recorded and sent: enabled, and a real publisher (vLLM's "null" sends nothing)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def for_rank(self, rank: int) -> KVEventsConfig:
        """Data-parallel core `rank`'s sockets, as vLLM offsets them (its ZmqEventPublisher's
        offset_endpoint_port): a tcp port plus the rank, any other endpoint with `_dp<rank>` after
        it; rank 0 unchanged. The replay endpoint moves the same way."""
        if rank == 0:
            return self
        return dataclasses.replace(
            self,
            endpoint=offset_endpoint(self.endpoint, rank),
            replay_endpoint=offset_endpoint(self.replay_endpoint, rank) if self.replay_endpoint else None,
        )

    @staticmethod
    def from_json(text: str) -> KVEventsConfig:
        """The flag's JSON object; unknown fields and wrong types are a ConfigError naming the field."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-events-config: invalid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError("--kv-events-config: expected a JSON object")
        fields = [f.name for f in dataclasses.fields(KVEventsConfig)]
        kinds = {"enable_kv_cache_events": bool, "buffer_steps": int, "hwm": int, "max_queue_size": int}
        for key, value in raw.items():
            if key not in fields:
                raise ConfigError(f"--kv-events-config: unknown field '{key}'; known: {', '.join(fields)}")
            kind = kinds.get(key, str)
            if value is None and key in ("publisher", "replay_endpoint"):
                continue
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"--kv-events-config: field '{key}' must be {kind.__name__}, got {value!r}")
        return KVEventsConfig(**raw)
