"""NVFP4 linears end to end in the engine: quantize at load, `fp4serve quantize` in the ModelOpt and
compressed-tensors layouts and loading them back, exact per-shard scales in fused linears, resident
bytes, quality against the float model, and one-line errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.batch import build_forward_batch
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import ConfigError
from engine.front.offline import OfflineEngine
from engine.model_runner import ModelRunner
from engine.models.layers import Linear
from engine.weights.config.model_config import ModelConfig
from fp4serve_tools.quantize import main as quantize_main
from fp4serve_tools.quantize import quantize_checkpoint
from kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4, quantize_nvfp4, to_modelopt
from kernels.nvfp4_matmul import NVFP4Linear
from kernels.nvfp4_scale_search import quantize_nvfp4_searched
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import SamplingParams
from tests.factories import TINY, make_checkpoint

FORMATS = ("modelopt", "compressed-tensors")
# qwen3: q/k norms, untied lm_head (stays float); llama: tied embeddings, attention and MLP biases.
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3": dict(arch="qwen3", tie=False),
    "llama_bias": dict(arch="llama", tie=True, attention_bias=True, mlp_bias=True),
}
CPU = torch.device("cpu")
F32_BYTES = 4


# ---- factories -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str | None], Path]:
    """(arch, format or None) -> a float checkpoint, or its NVFP4 copy written by `fp4serve quantize`."""
    cache: dict[tuple[str, str | None], Path] = {}

    def get(arch: str, fmt: str | None = None) -> Path:
        if (arch, fmt) not in cache:
            if fmt is None:
                cache[arch, fmt] = make_checkpoint(tmp_path_factory.mktemp(arch), **ARCHS[arch])
            else:
                dst = tmp_path_factory.mktemp(f"{arch}-{fmt}") / "out"
                quantize_checkpoint(get(arch), dst, fmt, CPU)
                cache[arch, fmt] = dst
        return cache[arch, fmt]

    return get


def make_runner(path: Path, **overrides: Any) -> ModelRunner:
    config = EngineConfig(**{"model": str(path), "dtype": "float32", "kv_cache_memory": "2MiB", **overrides})
    return ModelRunner(path, ModelConfig.from_checkpoint(path), config, max_model_len=256)


def position_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] float32: the logits after every prompt position, from one prefill."""
    num_pages = -(-len(prompt) // runner.block_size)
    request = ScheduledRequest("r", tuple(prompt), 0, tuple(range(num_pages)), sample=False)
    batch = build_forward_batch(SchedulerOutput((request,), ()), runner.block_size, runner.device)
    runner.backend.plan(batch)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, runner.backend)
        return runner.model.compute_logits(hidden)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"] - 1, (n,), generator=g).tolist() for n in lengths]


def nvfp4_linears(runner: ModelRunner) -> dict[str, NVFP4Linear]:
    return {name: m for name, m in runner.model.named_modules() if isinstance(m, NVFP4Linear)}


def operand(layer: NVFP4Linear) -> NVFP4Weight:
    assert isinstance(layer.operand, NVFP4Weight), "on CPU the resident operand is the canonical weight"
    return layer.operand


def edit_tensors(path: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def edit_json(path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    raw = json.loads(path.read_text())
    fn(raw)
    path.write_text(json.dumps(raw))


def ulp_apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal or neighbouring float32 values, elementwise."""
    return bool(((a == b) | (torch.nextafter(a, b) == b)).all())


# ---- quantize at load == written checkpoint -------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_written_checkpoint_loads_to_the_logits_of_quantize_at_load(ckpts: Any, arch: str, fmt: str) -> None:
    at_load = make_runner(ckpts(arch), quantization="nvfp4")
    written = make_runner(ckpts(arch, fmt))
    ours, theirs = nvfp4_linears(at_load), nvfp4_linears(written)
    assert sorted(ours) == sorted(theirs) and len(ours) == 4 * TINY["num_hidden_layers"]
    for name, layer in ours.items():
        a, b = operand(layer), operand(theirs[name])
        assert torch.equal(a.packed, b.packed)
        assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
        assert a.shard_sizes == b.shard_sizes
        if fmt == "compressed-tensors":  # stores S itself
            assert torch.equal(a.global_scale, b.global_scale), name
        else:  # stores 1/S, which reads back as S or its float32 neighbour
            assert ulp_apart(a.global_scale, b.global_scale), name
        if layer.bias is not None:
            assert torch.equal(layer.bias, theirs[name].bias)
    for prompt in random_prompts([1, 17, 40]):
        ref, got = position_logits(at_load, prompt), position_logits(written, prompt)
        if fmt == "compressed-tensors":
            assert torch.equal(ref, got)
        else:
            assert (ref - got).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_generation_of_written_checkpoint_equals_quantize_at_load(ckpts: Any, fmt: str) -> None:
    prompts = random_prompts([3, 16, 29], seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def generate(path: Path, **overrides: Any) -> list[list[int]]:
        config = EngineConfig(model=str(path), dtype="float32", kv_cache_memory="2MiB", **overrides)
        return [r.token_ids[0] for r in OfflineEngine.from_config(config).generate(prompts, params)]

    at_load = generate(ckpts("qwen3"), quantization="nvfp4")
    assert [len(t) for t in at_load] == [12, 12, 12]
    assert generate(ckpts("qwen3", fmt)) == at_load


# ---- resident weights --------------------------------------------------------------------------


def test_resident_weights_are_packed_codes_scales_and_the_float_excludes(
    ckpts: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="fp4serve.runner")
    runner = make_runner(ckpts("qwen3"), quantization="nvfp4")
    cfg = runner.model_config
    layers = range(cfg.num_layers)
    linears = nvfp4_linears(runner)
    assert sorted(linears) == sorted(
        f"layers.{i}.{m}"
        for i in layers
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    )
    assert type(runner.model.lm_head) is Linear  # excluded: stays float
    shapes = {(m.out_features, m.in_features) for m in linears.values()}
    shapes |= {(n, op.shape[1]) for m in linears.values() for op in [operand(m)] for n in op.shard_sizes or ()}
    resident = list(runner.model.state_dict().values())
    resident += [
        t for m in linears.values() for t in (operand(m).packed, operand(m).block_scale, operand(m).global_scale)
    ]
    for t in resident:
        if t.is_floating_point() and t.dtype != torch.float8_e4m3fn:
            assert tuple(t.shape) not in shapes and tuple(t.shape[::-1]) not in shapes, tuple(t.shape)

    def nvfp4_bytes(n: int, k: int, num_shards: int) -> int:  # codes, E4M3 block scales, fp32 S per shard
        return n * k // 2 + n * k // 16 + F32_BYTES * num_shards

    q, kv, h, ffn = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    per_layer = (
        nvfp4_bytes(q + 2 * kv, h, 3) + nvfp4_bytes(h, q, 1) + nvfp4_bytes(2 * ffn, h, 2) + nvfp4_bytes(h, ffn, 1)
    )
    expected_nvfp4 = cfg.num_layers * per_layer
    # embed_tokens, untied lm_head, final norm; per layer two norms and the q/k norms, all float32
    expected_float = F32_BYTES * (2 * cfg.vocab_size * h + h + cfg.num_layers * (2 * h + 2 * cfg.head_dim))
    assert runner.nvfp4_weight_nbytes == expected_nvfp4
    assert runner.weight_nbytes == expected_float + expected_nvfp4
    mib = 1 << 20
    assert (
        f"weights: {runner.weight_nbytes / mib:.2f} MiB resident (nvfp4 linears: {expected_nvfp4 / mib:.2f} MiB "
        f"in {len(linears)} layers)"
    ) in caplog.messages


def test_float_model_reports_its_weight_bytes_and_no_nvfp4(ckpts: Any) -> None:
    runner = make_runner(ckpts("qwen3"))
    assert not nvfp4_linears(runner) and runner.nvfp4_weight_nbytes == 0
    expected = sum(t.nbytes for t in load_file(ckpts("qwen3") / "model.safetensors").values())
    assert runner.weight_nbytes == expected  # float32 checkpoint loaded as float32: the same bytes


# ---- quality -----------------------------------------------------------------------------------


def test_nvfp4_next_token_agrees_with_float_on_200_positions(tmp_path: Path) -> None:
    # NOTE: untied: with tied embeddings a random model mostly predicts its input token, and
    # agreement would be ~0.99 whatever the quantization did.
    src = make_checkpoint(tmp_path / "m", "qwen3", tie=False, init_std=0.02, seed=3)
    float_runner, nvfp4_runner = make_runner(src), make_runner(src, quantization="nvfp4")
    agree = total = 0
    for prompt in random_prompts([50, 50, 50, 50], seed=11):
        ref, got = position_logits(float_runner, prompt), position_logits(nvfp4_runner, prompt)
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        total += len(prompt)
    print(f"NVFP4 vs float top-1 next-token agreement: {agree}/{total} = {agree / total:.3f}")
    assert total == 200 and agree / total >= 0.6


# ---- fused shards ------------------------------------------------------------------------------


def test_fused_shards_of_different_magnitudes_keep_their_own_scales(ckpts: Any, tmp_path: Path) -> None:
    path = shutil.copytree(ckpts("qwen3"), tmp_path / "m")
    prefix = "model.layers.0.self_attn"

    def spread(t: dict[str, torch.Tensor]) -> None:
        t[f"{prefix}.q_proj.weight"] *= 300.0
        t[f"{prefix}.k_proj.weight"] *= 0.003

    edit_tensors(path, spread)
    stored = load_file(path / "model.safetensors")
    shards = [quantize_nvfp4_searched(stored[f"{prefix}.{p}_proj.weight"]) for p in "qkv"]
    layer = nvfp4_linears(make_runner(path, quantization="nvfp4"))["layers.0.self_attn.qkv_proj"]
    fused = operand(layer)
    assert fused.shard_sizes == (64, 32, 32)
    assert torch.equal(fused.global_scale, torch.stack([s.global_scale for s in shards]))
    assert len(set(fused.global_scale.tolist())) == 3
    per_shard = torch.cat([dequantize_nvfp4(s, torch.float32) for s in shards])
    assert torch.equal(dequantize_nvfp4(fused, torch.float32), per_shard)
    x = torch.randn(5, TINY["hidden_size"], generator=torch.Generator().manual_seed(0))
    assert torch.equal(layer(x), F.linear(x, per_shard))
    # One shared scale (vLLM's max) would lose the small k shard: it is not this.
    shared = dequantize_nvfp4(
        quantize_nvfp4(torch.cat([stored[f"{prefix}.{p}_proj.weight"] for p in "qkv"])), torch.float32
    )
    assert not torch.equal(shared, per_shard)


# ---- the writer -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_writer_stores_each_hf_linear_in_the_layout_and_copies_the_rest(ckpts: Any, fmt: str) -> None:
    src, dst = ckpts("qwen3"), ckpts("qwen3", fmt)
    tensors = load_file(dst / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj"
    h = TINY["hidden_size"]
    if fmt == "modelopt":
        expected = {
            "weight": (torch.uint8, (64, h // 2)),
            "weight_scale": (torch.float8_e4m3fn, (64, h // 16)),
            "weight_scale_2": (torch.float32, ()),
        }
    else:
        expected = {
            "weight_packed": (torch.uint8, (64, h // 2)),
            "weight_scale": (torch.float8_e4m3fn, (64, h // 16)),
            "weight_global_scale": (torch.float32, (1,)),
        }
    written = {k.removeprefix(q + "."): (v.dtype, tuple(v.shape)) for k, v in tensors.items() if k.startswith(q + ".")}
    assert written == expected
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in tensors)
    source = load_file(src / "model.safetensors")
    kept = (
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
    )
    for name in kept:
        assert torch.equal(tensors[name], source[name])
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == fmt
    assert (dst / "hf_quant_config.json").is_file() == (fmt == "modelopt")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()


def test_quantize_command_prints_resident_bytes_before_and_after(
    ckpts: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = ckpts("qwen3"), tmp_path / "out"
    assert quantize_main([str(src), str(dst), "--format", "compressed-tensors", "--device", "cpu"]) == 0
    before = sum(t.nbytes for t in load_file(src / "model.safetensors").values())
    after = sum(t.nbytes for t in load_file(dst / "model.safetensors").values())
    out = capsys.readouterr().out
    mib = 1 << 20
    assert f"weights: {before / mib:.2f} MiB -> {after / mib:.2f} MiB" in out
    assert "14 linears" in out and f"fp4serve serve --model {dst}" in out
    assert not list(tmp_path.glob(".*partial"))


def test_sharded_source_gives_a_sharded_checkpoint_that_loads_alike(ckpts: Any, tmp_path: Path) -> None:
    src = shutil.copytree(ckpts("qwen3"), tmp_path / "sharded")
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, src / file, metadata={"format": "pt"})
    weight_map = {n: f for f, part in halves.items() for n in part}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    dst = tmp_path / "out"
    quantize_checkpoint(src, dst, "modelopt", CPU)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    stored = {n: f for f in halves for n in load_file(dst / f)}
    assert index["weight_map"] == stored and len(stored) == len(names) + 2 * 14  # two scales per linear
    prompt = random_prompts([20], seed=2)[0]
    single_file = make_runner(ckpts("qwen3", "modelopt"))
    assert torch.equal(position_logits(make_runner(dst), prompt), position_logits(single_file, prompt))


def test_quantize_refuses_a_quantized_source_and_a_nonempty_destination(
    ckpts: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert quantize_main([str(ckpts("qwen3", "modelopt")), str(tmp_path / "a")]) == 2
    assert "already quantized" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("x")
    assert quantize_main([str(ckpts("qwen3")), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "exists and is not an empty folder" in err and err.count("\n") == 1
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["keep.txt"]


# ---- checkpoints from other producers ----------------------------------------------------------


def test_modelopt_checkpoint_with_quantized_lm_head_loads_it_as_nvfp4(ckpts: Any, tmp_path: Path) -> None:
    path = shutil.copytree(ckpts("qwen3", "modelopt"), tmp_path / "m")
    head = quantize_nvfp4(load_file(path / "model.safetensors")["lm_head.weight"])

    def quantize_head(t: dict[str, torch.Tensor]) -> None:
        del t["lm_head.weight"]
        t.update({f"lm_head.{k}": v for k, v in to_modelopt(head).items()})
        t["lm_head.input_scale"] = torch.tensor(0.01)  # W4A4 scale: skipped, weight-only here

    edit_tensors(path, quantize_head)
    runner = make_runner(path)
    assert isinstance(runner.model.lm_head, NVFP4Linear)
    hidden = torch.randn(3, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = runner.model.compute_logits(hidden)
    assert torch.equal(logits, F.linear(hidden, dequantize_nvfp4(operand(runner.model.lm_head), torch.float32)))


# ---- errors ------------------------------------------------------------------------------------


def start(path: Path, **overrides: Any) -> None:
    EngineCore(EngineConfig(model=str(path), dtype="float32", kv_cache_memory="2MiB", **overrides))


def _set(key_path: list[str], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        node = raw
        for key in key_path[:-1]:
            node = node[key]
        node[key_path[-1]] = value

    return edit


CONFIG_ERRORS = {
    "modelopt_fp8": (
        "modelopt",
        "hf_quant_config.json",
        ["quantization", "quant_algo"],
        "FP8",
        r"hf_quant_config\.json: unsupported quant_algo 'FP8' in field 'quantization\.quant_algo'",
    ),
    "modelopt_group_32": (
        "modelopt",
        "hf_quant_config.json",
        ["quantization", "group_size"],
        32,
        r"needs group_size 16, got 32 in field 'quantization\.group_size'",
    ),
    "gptq": (
        "compressed-tensors",
        "config.json",
        ["quantization_config", "quant_method"],
        "gptq",
        r"unsupported quantization 'gptq' in field 'quantization_config\.quant_method'",
    ),
    "ct_int8": (
        "compressed-tensors",
        "config.json",
        ["quantization_config", "config_groups", "group_0", "weights", "num_bits"],
        8,
        r"num_bits 4, got 8 in field 'quantization_config\.config_groups\.group_0\.weights\.num_bits'",
    ),
    "ct_fp8_format": (
        "compressed-tensors",
        "config.json",
        ["quantization_config", "config_groups", "group_0", "format"],
        "float-quantized",
        r"format 'float-quantized' in field 'quantization_config\.config_groups\.group_0\.format'",
    ),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS)
def test_unsupported_quantization_config_fails_with_one_line_naming_the_field(
    ckpts: Any, tmp_path: Path, case: str
) -> None:
    fmt, file, key_path, value, message = CONFIG_ERRORS[case]
    path = shutil.copytree(ckpts("qwen3", fmt), tmp_path / "m")
    edit_json(path / file, _set(key_path, value))
    with pytest.raises(ConfigError, match=message) as e:
        start(path)
    assert "\n" not in str(e.value)


def test_missing_nvfp4_scale_is_named(ckpts: Any, tmp_path: Path) -> None:
    path = shutil.copytree(ckpts("qwen3", "modelopt"), tmp_path / "m")
    edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale_2"))
    with pytest.raises(ConfigError, match=r"missing tensor for 'model\.layers\.1\.mlp\.up_proj\.weight_scale_2'"):
        start(path)


def test_fused_linear_with_one_float_shard_is_refused(ckpts: Any, tmp_path: Path) -> None:
    path = shutil.copytree(ckpts("qwen3", "compressed-tensors"), tmp_path / "m")
    k = "model.layers.0.self_attn.k_proj"
    float_k = load_file(ckpts("qwen3") / "model.safetensors")[f"{k}.weight"]

    def unquantize_k(t: dict[str, torch.Tensor]) -> None:
        for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
            del t[f"{k}.{suffix}"]
        t[f"{k}.weight"] = float_k

    edit_tensors(path, unquantize_k)
    with pytest.raises(ConfigError, match=rf"q_proj is NVFP4 but {k}\b.* is not"):
        start(path)


def test_quantize_at_load_needs_whole_16_element_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = make_checkpoint(tmp_path / "m", "qwen3", intermediate_size=72)
    with pytest.raises(ConfigError, match=r"--quantization nvfp4: intermediate_size = 72 is not a multiple of 16"):
        start(path, quantization="nvfp4")
    assert quantize_main([str(path), str(tmp_path / "out")]) == 2
    assert "intermediate_size = 72 is not a multiple of 16" in capsys.readouterr().err


def test_unknown_quantization_flag_is_named(ckpts: Any) -> None:
    with pytest.raises(ConfigError, match=r"--quantization: 'int3' is not one of auto, none, nvfp4, int8, int4"):
        start(ckpts("qwen3"), quantization="int3")
