"""`python -m bench.agent_memory`: the resident memory of a server and its engine process while
coding agents are served — 6-19k-token prompts (a system prompt plus a long history), large tool
sets (each agent its own, some turns with a few extra MCP-style tools), `tool_choice: "required"`
(a grammar per tool set), several at once — sampled from /proc every 100 ms. Starts the server
(or attaches to --url, whose /health names the engine's pid) and prints the peaks, the RSS once
idle, and the timeline as JSON with --out.

The numbers are the machine's: run it back to back for a before/after, never across machines."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil

from bench.datasets import COMMON_WORDS

SERVE_ARGS = (
    "--model",
    "fp4serve-demo-qwen3",
    "--max-model-len",
    "20480",
    "--kv-cache-memory",
    "256MiB",
    "--tool-parser",
    "qwen3",
)
TYPES = ("string", "integer", "boolean", "number")


def make_tool(rng: random.Random, name: str) -> dict[str, Any]:
    """A function with 3-10 parameters, some enums, arrays and a nested object, like a CLI's."""
    props: dict[str, Any] = {}
    for i in range(rng.randint(3, 10)):
        kind = rng.random()
        if kind < 0.15:
            values = [rng.choice(COMMON_WORDS) + str(j) for j in range(rng.randint(2, 6))]
            props[f"p{i}"] = {"type": "string", "enum": values}
        elif kind < 0.3:
            props[f"p{i}"] = {"type": "array", "items": {"type": rng.choice(TYPES)}}
        elif kind < 0.4:
            props[f"p{i}"] = {
                "type": "object",
                "properties": {f"q{j}": {"type": rng.choice(TYPES)} for j in range(3)},
                "required": ["q0"],
            }
        else:
            props[f"p{i}"] = {"type": rng.choice(TYPES), "description": " ".join(rng.choices(COMMON_WORDS, k=12))}
    required = sorted(rng.sample(sorted(props), k=max(1, len(props) // 2)))
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": " ".join(rng.choices(COMMON_WORDS, k=40)),
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


@dataclass
class Agent:
    name: str
    tools: list[dict[str, Any]]
    system: str


def make_agents(rng: random.Random, num_agents: int, num_tools: int) -> list[Agent]:
    agents = []
    for a in range(num_agents):
        tools = [make_tool(rng, f"agent{a}_tool{t}") for t in range(num_tools)]
        agents.append(Agent(f"agent{a}", tools, " ".join(rng.choices(COMMON_WORDS, k=3000))))
    return agents


# What the chat template makes of 20 tools of make_tool's kind, in Qwen tokens (measured on the demo).
TOOL_TOKENS = 250


def turn_request(rng: random.Random, agent: Agent, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    """One turn of about `prompt_tokens` tokens: the agent's system prompt (3000 one-token words),
    its tools (plus 0-3 extra ones: a new grammar), a history filling the rest; a forced call."""
    filler = prompt_tokens - 3000 - TOOL_TOKENS * len(agent.tools)
    history = " ".join(rng.choices(COMMON_WORDS, k=max(filler, 10)))
    extra = [make_tool(rng, f"mcp_{rng.randrange(10**6)}") for _ in range(rng.choice((0, 0, 1, 3)))]
    return {
        "messages": [{"role": "system", "content": agent.system}, {"role": "user", "content": history}],
        "tools": agent.tools + extra,
        "tool_choice": "required",
        "max_tokens": max_tokens,
        "extra_body": {"ignore_eos": True},
    }


@dataclass
class Sampler:
    """RSS of the server and the engine process every `interval_s`, on a thread."""

    server_pid: int
    engine_pid: int
    interval_s: float = 0.1
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, server bytes, engine bytes)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._server, self._engine = psutil.Process(self.server_pid), psutil.Process(self.engine_pid)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(
                    (time.monotonic() - self._t0, self._server.memory_info().rss, self._engine.memory_info().rss)
                )
            except psutil.NoSuchProcess:
                return

    def stop(self) -> None:
        self._stop.set()


async def drive(
    base_url: str,
    model: str,
    agents: list[Agent],
    num_requests: int,
    concurrency: int,
    lengths: tuple[int, int],
    max_tokens: int,
    seed: int,
) -> list[str]:
    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=1800)
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for _ in range(num_requests):
        queue.put_nowait(turn_request(rng, rng.choice(agents), rng.randint(*lengths), max_tokens))
    outcomes: list[str] = []

    async def worker() -> None:
        while not queue.empty():
            body = queue.get_nowait()
            extra = body.pop("extra_body")
            try:
                out = await client.chat.completions.create(model=model, extra_body=extra, **body)
                outcomes.append(f"{out.usage.prompt_tokens}:{out.choices[0].finish_reason}")
            except openai.APIError as e:
                outcomes.append(f"error: {e}")

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return outcomes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agent_memory", description=__doc__)
    p.add_argument("--url", help="an fp4serve server to attach to; default: start one with SERVE_ARGS")
    p.add_argument("--serve-args", default="", help="more flags for the server this starts")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-agents", type=int, default=3, help="distinct tool sets")
    p.add_argument("--num-tools", type=int, default=20, help="tools per agent")
    p.add_argument("--min-len", type=int, default=6000)
    p.add_argument("--max-len", type=int, default=19000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--idle-s", type=float, default=10.0, help="sampling after the last request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the samples and the summary as JSON here")
    args = p.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        port = 18000 + os.getpid() % 1000
        log = Path(tempfile.mkstemp(prefix="agent-memory-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "api.cli", "serve", "--port", str(port), *SERVE_ARGS, *args.serve_args.split()]
        proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        print(f"server log: {log}", file=sys.stderr)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                health = httpx.get(url + "/health", timeout=2)
                if health.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        body = health.json()
        server_pid = proc.pid if proc is not None else psutil.Process(body["engine_pid"]).ppid()
        sampler = Sampler(server_pid, body["engine_pid"])
        sampler.start()
        time.sleep(1.0)
        agents = make_agents(random.Random(args.seed), args.num_agents, args.num_tools)
        t0 = time.monotonic()
        outcomes = asyncio.run(
            drive(
                url + "/v1",
                body["model"],
                agents,
                args.num_requests,
                args.concurrency,
                (args.min_len, args.max_len),
                args.max_tokens,
                args.seed,
            )
        )
        took = time.monotonic() - t0
        time.sleep(args.idle_s)
        sampler.stop()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    s = sampler.samples
    mib = 2**20
    summary = {
        "requests": len(outcomes),
        "errors": sum(o.startswith("error") for o in outcomes),
        "took_s": round(took, 1),
        "engine_rss_start_mib": round(s[0][2] / mib),
        "engine_rss_peak_mib": round(max(x[2] for x in s) / mib),
        "engine_rss_idle_mib": round(s[-1][2] / mib),
        "server_rss_peak_mib": round(max(x[1] for x in s) / mib),
        "both_peak_mib": round(max(x[1] + x[2] for x in s) / mib),
        "outcomes": outcomes,
    }
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "samples": s, "args": vars(args)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
