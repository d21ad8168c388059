"""`python -m bench serve | plot | compare` against the real fp4serve server (demo model) on
127.0.0.1: the JSON, the token counts the server reports, and the workloads' effect on it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.datasets import DatasetSpec, LocalTokenizer, build_dataset
from bench.report import Result, load_results
from engine.weights.demo_model import ensure_demo_model
from tests.server_utils import HTTP, RunningServer, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server("--max-model-len", "1024", "--max-num-seqs", "8") as s:
        yield s


def bench_serve(server: RunningServer, out: Path, *flags: str) -> list[Result]:
    # temperature 1: a random-weight model decoded greedily can settle on a token that
    # renders as no text, which the bench rightly counts as an empty output.
    code = main(
        [
            "serve",
            "--base-url",
            server.url("/v1"),
            "--temperature",
            "1",
            "--tokenizer",
            str(ensure_demo_model()),
            "--duration",
            "120",
            "--no-progress",
            "--out",
            str(out),
            *flags,
        ]
    )
    assert code == 0
    return load_results(out)


def prefix_cache_hits(server: RunningServer) -> float:
    text = HTTP.get(server.url("/metrics"), timeout=10).text
    match = re.search(r"^fp4serve_prefix_cache_hits_total (\S+)$", text, re.M)
    assert match, "the server exports fp4serve_prefix_cache_hits_total"
    return float(match.group(1))


def test_chat_sweep_measures_every_request_with_server_usage(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep.json"
    results = bench_serve(
        server,
        out,
        "--concurrency",
        "1,4",
        "--num-requests",
        "4",
        "--input-len",
        "32",
        "--output-len",
        "8",
        "--label",
        "fp4serve",
    )
    assert [r["config"]["load_label"] for r in results] == ["c=1", "c=4"]
    for result in results:
        summary, requests = result["summary"], result["requests"]
        assert (summary["completed"], summary["failed"], summary["errors"]) == (4, 0, {})
        # The demo model's own tokenizer.json (--tokenizer): prompt lengths are exact.
        assert result["config"]["tokenizer"].startswith("local:")
        assert "/.cache/" not in result["config"]["tokenizer"]  # no local path in a results file
        assert len(requests) == 4
        for req in requests:
            assert 0 < req["ttft_ms"] <= req["e2e_ms"]
            assert req["usage"] == "server"
            assert req["output_tokens"] == 8  # ignore_eos + min_tokens honoured
        # 32 content tokens each, plus the same chat-template tokens around them.
        assert len({req["prompt_tokens"] for req in requests}) == 1
        assert requests[0]["prompt_tokens"] > 32
        assert summary["total_output_tokens"] == 32
        assert summary["output_throughput"] > 0 and summary["ttft_ms.p99"] >= summary["ttft_ms.p50"]
    capsys.readouterr()
    assert main(["plot", str(out), "--out", str(tmp_path / "png")]) == 0
    assert {p.name for p in (tmp_path / "png").glob("*.png")} == {
        "latency_cdf.png",
        "latency_vs_throughput.png",
        "throughput_vs_load.png",
    }
    assert main(["compare", str(out), str(out)]) == 0
    assert "TTFT p99 (ms)" in capsys.readouterr().out


def test_completions_prompts_are_exactly_input_len_tokens(server: RunningServer, tmp_path: Path) -> None:
    (result,) = bench_serve(
        server,
        tmp_path / "c.json",
        "--endpoint",
        "completions",
        "--concurrency",
        "2",
        "--num-requests",
        "4",
        "--input-len",
        "40",
        "--output-len",
        "4",
        "--range-ratio",
        "0.5",
    )
    requests = result["requests"]
    assert result["summary"]["failed"] == 0
    # Rebuild the same prompts: with no template on /v1/completions the server must count
    # exactly the tokens each was built to have.
    convs = build_dataset(DatasetSpec(**result["config"]["dataset"]), LocalTokenizer(ensure_demo_model()))
    built = {c.conversation_id: c.turns[0] for c in convs}
    assert len({t.num_tokens for t in built.values()}) > 1  # the range ratio varies them
    for req in requests:
        turn = built[req["conversation_id"]]
        assert 20 <= turn.num_tokens <= 60
        assert req["prompt_tokens"] == turn.num_tokens
        assert req["output_tokens"] == req["max_tokens"] == turn.max_tokens


def test_multi_turn_prompts_grow_by_the_previous_answer(server: RunningServer, tmp_path: Path) -> None:
    (result,) = bench_serve(
        server,
        tmp_path / "m.json",
        "--dataset",
        "multi-turn",
        "--num-turns",
        "3",
        "--concurrency",
        "2",
        "--num-requests",
        "6",
        "--input-len",
        "24",
        "--output-len",
        "6",
    )
    assert result["summary"]["failed"] == 0
    by_conv: dict[int, list[tuple[int, int]]] = {}
    for req in result["requests"]:
        by_conv.setdefault(req["conversation_id"], []).append((req["turn"], req["prompt_tokens"]))
    assert sorted(by_conv) == [0, 1]
    for turns in by_conv.values():
        prompts = [n for _, n in sorted(turns)]
        assert len(prompts) == 3
        # Each turn adds the previous answer (6 tokens, re-encoded) and 24 new user tokens.
        assert all(b - a >= 24 + 3 for a, b in zip(prompts, prompts[1:]))


def test_shared_prefix_workload_hits_the_prefix_cache(server: RunningServer, tmp_path: Path) -> None:
    before = prefix_cache_hits(server)
    (result,) = bench_serve(
        server,
        tmp_path / "s.json",
        "--dataset",
        "shared-prefix",
        "--prefix-len",
        "64",
        "--num-groups",
        "1",
        "--concurrency",
        "1",
        "--num-requests",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "2",
    )
    assert result["summary"]["completed"] == 4
    # Three of the four requests reuse at least the prefix's full 16-token pages.
    assert prefix_cache_hits(server) - before >= 3 * 48
