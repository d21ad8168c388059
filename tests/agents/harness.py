"""The server side of the agent tests: `fp4serve serve` running an agent test model with
`--tool-parser auto --reasoning-parser auto`, behind a recording proxy (tests/agents/proxy.py), and
what a test reads back: each request's status, whether a failed one was recovered, and the
server's request log lines (prompt tokens, cached tokens, TTFT)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4serve_tools.agent_model import SPEC_FILE
from tests.agents.clis import API_KEY
from tests.agents.proxy import Exchange, RecordingProxy
from tests.server_utils import HTTP, RunningServer, start_server

MAX_MODEL_LEN = 65_536  # the agents' prompts (6-19k tokens) plus the 32,000 max_tokens they ask for
# KV for MAX_MODEL_LEN tokens of the agent model (3 layers x 3 heads x 192 x K,V x bf16: 6.75 KiB a
# token), and some room: the default KV size on a CPU would lower the context to ~39k.
KV_CACHE_MEMORY = "512MiB"
# One request log line (engine/front/output_processor.py).
_REQUEST_LINE = re.compile(
    r"(?P<id>\S+) key=\S+ prompt=(?P<prompt>\d+) completion=(?P<completion>\d+) cached=(?P<cached>\d+) "
    r"ttft=(?P<ttft>[\d.]+)s"
)


@dataclass(frozen=True)
class RequestLine:
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass
class AgentServer:
    server: RunningServer
    proxy: RecordingProxy
    model: str

    @property
    def base_url(self) -> str:
        """Where the CLIs are pointed: the proxy, which forwards to the server."""
        return self.proxy.base_url

    def request_lines(self) -> list[RequestLine]:
        return [
            RequestLine(m["id"], int(m["prompt"]), int(m["completion"]), int(m["cached"]), float(m["ttft"]))
            for m in _REQUEST_LINE.finditer(self.server.log())
        ]


@contextmanager
def agent_server(model_path: Path, *extra: str) -> Iterator[AgentServer]:
    name = json.loads((model_path / SPEC_FILE).read_text())["name"]  # not the cache folder's name
    # With a key, as a team endpoint runs: each CLI's way of sending it is checked too.
    server = start_server(
        "--model",
        str(model_path),
        "--served-model-name",
        name,
        "--tool-parser",
        "auto",
        "--reasoning-parser",
        "auto",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        KV_CACHE_MEMORY,
        *extra,
        api_key=API_KEY,
    )
    try:
        model = HTTP.get(server.url("/v1/models"), headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()[
            "data"
        ][0]["id"]
        assert model == name, (model, name)
        proxy = RecordingProxy(server.base_url).start()
        try:
            yield AgentServer(server, proxy, model)
        finally:
            proxy.stop()
    finally:
        server.stop()


def model_requests(exchanges: list[Exchange]) -> list[Exchange]:
    """The requests that ask the model for something (not /health, /v1/models, count_tokens)."""
    return [
        e
        for e in exchanges
        if e.method == "POST" and e.path in ("/v1/messages", "/v1/responses", "/v1/chat/completions")
    ]


def unrecovered(exchanges: list[Exchange]) -> list[Exchange]:
    """Failed requests (4xx, 5xx, no answer) that no later successful request to the same path
    followed: the ones a client could not recover from. Every 5xx counts."""
    out = []
    for i, e in enumerate(exchanges):
        if (
            e.status >= 500
            or e.status == 0
            or e.status >= 400
            and not any(200 <= later.status < 300 and later.path == e.path for later in exchanges[i + 1 :])
        ):
            out.append(e)
    return out


def mentions(exchange: Exchange, text: str) -> bool:
    """Whether the request body carries `text` anywhere (a tool result pasted back, say)."""
    return text in json.dumps(exchange.body, ensure_ascii=False)


def tool_names(body: dict[str, Any]) -> list[str]:
    """The tool names a request offers, whatever its API's shape (namespaces listed as such)."""
    names = []
    for tool in body.get("tools") or []:
        function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        names.append(str(function.get("name") or tool.get("type")))
    return names
