"""The CPU rehearsal of the GPU benchmark: `python -m bench.gpu --device cpu --tiny` runs the same code
as the device run (random checkpoint, the engine's loader at bf16 and NVFP4, decode steps through
ModelRunner.execute, the HBM floor, OfflineEngine and transformers throughput) for each model shape,
and its JSON holds every row with the floor's parts counted from the model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.gpu import main
from bench.random_checkpoint import config_dict
from bench.step_floor import expected_distinct_experts

BATCH_SIZES = (1, 64)
CONTEXT = 32
# A hybrid needs 4 layers for one gated-attention layer (every fourth) beside its DeltaNet layers.
LAYERS = {"qwen3-8b": 1, "qwen3.6-27b": 4, "qwen3-coder-30b-a3b": 1}


@pytest.fixture(scope="module", params=sorted(LAYERS))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    shape = request.param
    out = tmp_path_factory.mktemp(shape) / "gpu.json"
    assert (
        main(
            [
                "--device",
                "cpu",
                "--tiny",
                "--shape",
                shape,
                "--layers",
                str(LAYERS[shape]),
                "--batch-sizes",
                *map(str, BATCH_SIZES),
                "--context",
                str(CONTEXT),
                "--reps",
                "2",
                "--num-requests",
                "4",
                "--input-len",
                "16",
                "--output-len",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


def rows(run: dict[str, Any], fmt: str) -> dict[int, dict[str, Any]]:
    return {r["batch_size"]: r for r in run["steps"] if r["format"] == fmt}


def kv_bytes_per_token(raw: dict[str, Any]) -> int:
    """bf16 K and V of every full-attention layer, from config.json's own fields."""
    types = raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]
    return 2 * types.count("full_attention") * raw["num_key_value_heads"] * raw["head_dim"] * 2


@pytest.mark.slow
def test_every_batch_size_and_format_has_a_row_with_a_floor_and_throughput(run: dict[str, Any]) -> None:
    assert run["complete"] and run["device"].startswith("CPU") and run["torch"]
    assert (run["layers"], run["formats"], run["tiny"]) == (LAYERS[run["shape"]], ["bf16", "nvfp4"], True)
    assert run["copy_gbps"] > 0
    for fmt in ("bf16", "nvfp4"):
        by_batch = rows(run, fmt)
        assert sorted(by_batch) == list(BATCH_SIZES)
        for r in by_batch.values():
            assert r["eager_ms"] > 0 and r["graph_ms"] is None  # no CUDA graphs on CPU
            assert r["floor_ms"] > 0 and 0 < r["fraction_of_floor"]
            assert r["bytes_per_step"] == r["weight_bytes"] + r["expert_bytes"] + r["kv_bytes"] + r["state_bytes"]
    # NVFP4 stores 4.5 bits per linear weight: the same step reads fewer weight bytes.
    assert rows(run, "nvfp4")[1]["weight_bytes"] < rows(run, "bf16")[1]["weight_bytes"]
    systems = {(t["system"], t["format"]): t for t in run["throughput"]}
    assert set(systems) == {("fp4serve", "bf16"), ("fp4serve", "nvfp4"), ("transformers", "bf16")}
    for t in systems.values():
        assert t["output_tokens_per_s"] > 0 and (t["num_requests"], t["output_len"]) == (4, 4)
    assert systems["fp4serve", "nvfp4"]["phase_s"]["num_steps"] >= 4  # at least one step per output token


@pytest.mark.slow
def test_kv_bytes_are_each_sequences_context_over_the_attention_layers(run: dict[str, Any]) -> None:
    raw = config_dict(run["shape"], run["layers"], tiny=True)
    for b, r in rows(run, "bf16").items():
        assert r["kv_bytes"] == b * (CONTEXT + 1) * kv_bytes_per_token(raw)


@pytest.mark.slow
def test_moe_floor_reads_only_the_experts_the_batch_can_reach(run: dict[str, Any]) -> None:
    raw = config_dict(run["shape"], run["layers"], tiny=True)
    for fmt in ("bf16", "nvfp4"):
        one, many = rows(run, fmt)[1]["expert_bytes"], rows(run, fmt)[64]["expert_bytes"]
        experts = raw.get("num_experts", raw.get("num_local_experts"))  # transformers 5 writes the latter
        if experts is None:
            assert one == many == 0
            continue
        top_k = raw["num_experts_per_tok"]
        assert 0 < one < many
        want = expected_distinct_experts(experts, top_k, 64) / top_k  # batch 1 touches exactly top-k experts
        assert many / one == pytest.approx(want, rel=1e-3)


@pytest.mark.slow
def test_hybrid_floor_reads_and_writes_each_sequences_deltanet_state(run: dict[str, Any]) -> None:
    raw = config_dict(run["shape"], run["layers"], tiny=True)
    if "linear_num_key_heads" not in raw:  # no DeltaNet layers
        assert all(r["state_bytes"] == 0 for r in run["steps"])
        return
    key_dim = raw["linear_num_key_heads"] * raw["linear_key_head_dim"]
    value_dim = raw["linear_num_value_heads"] * raw["linear_value_head_dim"]
    conv = (2 * key_dim + value_dim) * (raw["linear_conv_kernel_dim"] - 1)
    recurrent = raw["linear_num_value_heads"] * raw["linear_key_head_dim"] * raw["linear_value_head_dim"]
    per_seq = 2 * 4 * (conv + recurrent) * raw["layer_types"].count("linear_attention")  # float32, read + write
    for fmt in ("bf16", "nvfp4"):
        for b, r in rows(run, fmt).items():
            assert r["state_bytes"] == b * per_seq > 0


def test_expected_distinct_experts_is_top_k_for_one_token_and_all_for_many() -> None:
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(128, 8, 16) == pytest.approx(128 * (1 - (120 / 128) ** 16))
    assert expected_distinct_experts(128, 8, 1000) == pytest.approx(128)
    counts = [expected_distinct_experts(128, 8, b) for b in (1, 2, 16, 64, 256)]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
