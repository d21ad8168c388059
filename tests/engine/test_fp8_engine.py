"""Block-wise FP8 checkpoints (Qwen's FP8 releases' layout, tests/fp8_factory.py) served on CPU:
the loader dequantizes them as they stream, exactly (every weight equals codes * block scale, as
transformers' own FineGrainedFP8 dequantization computes it), so greedy output equals transformers
on the dequantized weights token for token, for dense, MoE (per-expert and fused experts) and
hybrid (CausalLM and ConditionalGeneration names) models; `--quantization nvfp4` and `int8`
re-quantize the dequantized weights; bad FP8 checkpoints fail start-up with one line."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ConfigError
from engine.weights.config.model_config import ModelConfig
from engine.weights.formats.fp8 import Fp8Dequantizer, Fp8Format, fp8_format
from engine.weights.loader import load_model
from kernels.fp8_block import dequantize_block_fp8, quantize_block_fp8
from scheduler.request import SamplingParams
from tests.engine.test_engine_correctness import make_engine
from tests.factories import make_checkpoint, make_hybrid_checkpoint, make_hybrid_moe_checkpoint, make_moe_checkpoint
from tests.fp8_factory import block_dequantize, block_quantize, dequantized_copy, to_fp8_checkpoint

NUM_DECODE = 8
PROMPT_LENS = [1, 6, 19, 70]  # one token; short; over a page; over a 64-token delta-rule chunk
MAKERS: dict[str, Callable[[Path], Path]] = {
    "qwen3": lambda p: make_checkpoint(p, "qwen3"),
    "llama-untied": lambda p: make_checkpoint(p, "llama", tie=False),
    "qwen3-moe": lambda p: make_moe_checkpoint(p),
    "qwen3-moe-fused": lambda p: make_moe_checkpoint(p, seed=2),
    "hybrid": lambda p: make_hybrid_checkpoint(p),
    "hybrid-vl": lambda p: make_hybrid_checkpoint(p, layout="vl", seed=3),
    "hybrid-moe": lambda p: make_hybrid_moe_checkpoint(p, seed=1),
    "hybrid-moe-vl-fused": lambda p: make_hybrid_moe_checkpoint(p, layout="vl", seed=2),
}


def prompts(seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 510, (n,), generator=g).tolist() for n in PROMPT_LENS]


def transformers_greedy(path: Path, ps: list[list[int]], num_tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in ps:
        # NOTE: an explicit mask: generate would mask out prompt tokens equal to pad_token_id
        ids = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module", params=list(MAKERS))
def fp8_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(f"fp8-{request.param}")
    src = MAKERS[request.param](root / "float")
    return request.param, to_fp8_checkpoint(src, root / "fp8", fused_experts=request.param.endswith("fused"))


def test_greedy_output_equals_transformers_on_the_dequantized_weights(
    fp8_ckpt: tuple[str, Path], tmp_path: Path
) -> None:
    kind, fp8 = fp8_ckpt
    ps = prompts()
    engine = make_engine(fp8)
    got = [
        r.token_ids[0]
        for r in engine.generate(ps, SamplingParams(max_tokens=NUM_DECODE, temperature=0.0, ignore_eos=True))
    ]
    # NOTE: transformers' own FineGrainedFP8 dequantization is not the reference here: it derives
    # the block size from the scale grid (rows // grid rows), which is right only where every
    # dimension is whole 128-blocks (Qwen's releases; test_block_dequantization_is_exact), not in
    # these tiny models; and it leaves fused experts' scales unapplied.
    assert got == transformers_greedy(dequantized_copy(fp8, tmp_path / "ref"), ps, NUM_DECODE), kind


@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (3, 40, 130)])
def test_block_dequantization_is_exact(shape: tuple[int, ...]) -> None:
    """Partial blocks at both edges, whole blocks, and a stack of experts: the engine's dequantization
    equals codes * scale element by element (the test factory's loops and transformers' own
    Fp8Dequantize), and its quantizer is the same amax / 448 recipe as the factory's."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    codes, scale = block_quantize(w)
    got = dequantize_block_fp8(codes, scale, (128, 128))
    assert torch.equal(got, block_dequantize(codes, scale))
    if codes.dim() == 2 and all(s % 128 == 0 for s in shape):  # transformers needs whole blocks
        assert torch.equal(got, Fp8Dequantize(None)._dequantize_one(codes, scale, torch.float32))
    ours_codes, ours_scale = quantize_block_fp8(w)
    assert torch.equal(ours_scale, scale) and torch.equal(ours_codes.float(), codes.float())
    assert (got - w).abs().max() <= scale.max() * 16  # e4m3 keeps 3 mantissa bits: half an ulp at 448 is 16


def test_loaded_weights_are_the_dequantized_tensors(tmp_path: Path) -> None:
    fp8 = to_fp8_checkpoint(make_moe_checkpoint(tmp_path / "f"), tmp_path / "fp8")
    ref = load_file(str(dequantized_copy(fp8, tmp_path / "ref") / "model.safetensors"))
    model = load_model(fp8, ModelConfig.from_checkpoint(fp8), torch.float32, torch.device("cpu"), 64)
    qkv = torch.cat([ref[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight, qkv)
    experts = model.layers[2].mlp.experts
    assert torch.equal(
        experts.w13[5],
        torch.cat(
            [ref["model.layers.2.mlp.experts.5.gate_proj.weight"], ref["model.layers.2.mlp.experts.5.up_proj.weight"]]
        ),
    )
    assert torch.equal(experts.w2[7], ref["model.layers.2.mlp.experts.7.down_proj.weight"])
    assert torch.equal(model.layers[0].mlp.gate.weight, ref["model.layers.0.mlp.gate.weight"])  # never FP8


def test_dequantizer_pairs_tensors_in_any_order_and_splits_fused_experts() -> None:
    fmt = Fp8Format((128, 128))
    codes, scale = block_quantize(torch.randn(3, 2 * 40, 64))  # fused gate/up of 3 experts
    d = Fp8Dequantizer(fmt)
    assert list(d.feed("model.layers.0.mlp.experts.gate_up_proj_scale_inv", scale)) == []  # held
    out = dict(d.feed("model.layers.0.mlp.experts.gate_up_proj", codes))
    whole = block_dequantize(codes, scale)
    assert sorted(out) == sorted(
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(3) for p in ("gate", "up")
    )
    assert torch.equal(out["model.layers.0.mlp.experts.2.up_proj.weight"], whole[2, 40:])
    w_codes, w_scale = block_quantize(torch.randn(16, 64))
    assert list(d.feed("x.weight", w_codes)) == []  # codes first, scale later (another shard)
    [(name, value)] = list(d.feed("x.weight_scale_inv", w_scale))
    assert name == "x.weight" and torch.equal(value, block_dequantize(w_codes, w_scale))
    norm = torch.ones(64)
    assert list(d.feed("x.norm.weight", norm)) == [("x.norm.weight", norm)]
    list(d.feed("y.weight", w_codes))
    with pytest.raises(
        ConfigError, match=r"^tensor 'y\.weight' is float8_e4m3fn but 'y\.weight_scale_inv' is missing$"
    ):
        d.finish()


def _requantized_logits(path: Path, scheme: str | None, max_tokens: int = 4, **overrides: Any) -> torch.Tensor:
    """Every sampled row's logits over two prompts' greedy decoding (each step's rows in turn)."""
    engine = make_engine(path, quantization=scheme, **overrides)
    seen: list[torch.Tensor] = []
    sample = engine.core.runner.sampler.launch  # what the runner calls

    def record(logits: torch.Tensor, *args: Any) -> Any:
        seen.append(logits.clone())
        return sample(logits, *args)

    engine.core.runner.sampler.launch = record  # type: ignore[method-assign]
    engine.generate(prompts()[1:3], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return torch.cat(seen)


@pytest.mark.parametrize("scheme", ["nvfp4", "int8", "int4"])
def test_requantization_starts_from_the_dequantized_weights(scheme: str, tmp_path: Path) -> None:
    """`--quantization nvfp4|int8|int4` on an FP8 checkpoint gives exactly what it gives on the float
    checkpoint of the dequantized weights."""
    fp8 = to_fp8_checkpoint(make_hybrid_moe_checkpoint(tmp_path / "f", hidden_size=64), tmp_path / "fp8")
    ref = dequantized_copy(fp8, tmp_path / "ref")
    extra = {"dtype": "bfloat16"} if scheme in ("int8", "int4") else {}
    assert torch.equal(_requantized_logits(fp8, scheme, **extra), _requantized_logits(ref, scheme, **extra))


def test_start_up_log_names_the_format_and_resident_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fp8 = to_fp8_checkpoint(make_checkpoint(tmp_path / "f"), tmp_path / "fp8")
    with caplog.at_level(logging.INFO, logger="fp4serve.loader"):
        load_model(fp8, ModelConfig.from_checkpoint(fp8), torch.float32, torch.device("cpu"), 64)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint format:"))
    assert "FP8 block-wise (e4m3, 128x128 blocks" in line and "dequantized at load to float32" in line
    assert "14 FP8 tensors dequantized" in line and "weights resident:" in line  # 7 linears x 2 layers


def _edit_config(path: Path, **changes: Any) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            "no-scale",
            r"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' is float8_e4m3fn but "
            r"'model\.layers\.0\.self_attn\.k_proj\.weight_scale_inv' is missing$",
        ),
        (
            "bad-scale",
            r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight_scale_inv': scale of shape \[2, 2\], "
            r"expected \[1, 1\] \(128x128 blocks\)$",
        ),
        ("per-tensor", r"per-tensor FP8 \(no 'quantization_config\.weight_block_size'\) is not supported"),
        ("e5m2", r"unsupported FP8 format 'e5m2' in field 'quantization_config\.fmt'"),
        ("static", r"unsupported FP8 activation scheme 'static'"),
    ],
)
def test_bad_fp8_checkpoints_fail_start_up_with_one_line(edit: str, message: str, tmp_path: Path) -> None:
    fp8 = to_fp8_checkpoint(make_checkpoint(tmp_path / "f"), tmp_path / "fp8")
    tensors = load_file(str(fp8 / "model.safetensors"))
    if edit == "no-scale":
        del tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    elif edit == "bad-scale":
        tensors["model.layers.1.mlp.down_proj.weight_scale_inv"] = torch.ones(2, 2)
    elif edit == "per-tensor":
        _edit_config(fp8, weight_block_size=None)
    else:
        _edit_config(fp8, **({"fmt": "e5m2"} if edit == "e5m2" else {"activation_scheme": "static"}))
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=message) as error:
        make_engine(fp8)
    assert "\n" not in str(error.value)


def test_fp8_format_reads_what_qwen_declares() -> None:
    declared = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"],
    }
    assert fp8_format(declared) == Fp8Format((128, 128), ("lm_head", "model.layers.0.mlp.gate"))
    assert fp8_format({**declared, "modules_to_not_convert": None, "ignored_layers": ["lm_head"]}) == Fp8Format(
        (128, 128), ("lm_head",)
    )
    assert fp8_format({"quant_method": "modelopt"}) is None and fp8_format(None) is None


def test_fp4serve_quantize_turns_an_fp8_release_into_nvfp4(tmp_path: Path) -> None:
    """`fp4serve quantize` reads an FP8 source through the same dequantization: its NVFP4 checkpoint
    serves exactly what `--quantization nvfp4` makes of the dequantized float checkpoint."""
    from fp4serve_tools.quantize import quantize_checkpoint

    fp8 = to_fp8_checkpoint(make_moe_checkpoint(tmp_path / "f", seed=5), tmp_path / "fp8", fused_experts=True)
    report = quantize_checkpoint(fp8, tmp_path / "nvfp4", "compressed-tensors", torch.device("cpu"))
    assert report.num_quantized == 3 * (4 + 3 * 8)  # q/k/v/o and 8 experts' gate/up/down per layer
    written = json.loads((tmp_path / "nvfp4" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "compressed-tensors"
    ref = dequantized_copy(fp8, tmp_path / "ref")
    assert torch.equal(_requantized_logits(tmp_path / "nvfp4", None), _requantized_logits(ref, "nvfp4"))


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe-fused", "hybrid-moe", "hybrid-vl"])
def test_the_kept_fp8_path_builds_the_checkpoints_weights(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a GPU with FP8 tensor cores loads (Fp8Linear / Fp8Experts, built from the codes and scales
    as stored; fused shards and fused experts included), forced on CPU: every FP8 module's weight
    dequantizes to exactly the float model's, each Fp8Linear computes its float twin on activations
    rounded per (token, 128-group) to e4m3, the router and lm_head stay float, and the engine serves
    the kept model (the W8A8 torch reference on CPU)."""
    import torch.nn.functional as F

    import engine.weights.loader
    from engine.models.layers import Linear
    from kernels.fp8_block import quantize_activation_groups
    from kernels.fp8_dispatch import Fp8Experts, Fp8Linear

    fp8 = to_fp8_checkpoint(MAKERS[kind](tmp_path / "f"), tmp_path / "fp8", fused_experts=kind.endswith("fused"))
    cfg = ModelConfig.from_checkpoint(fp8)
    dense = load_model(fp8, cfg, torch.float32, torch.device("cpu"), 64)
    monkeypatch.setattr(engine.weights.loader, "keeps_fp8", lambda *args, **kwargs: True)
    kept = load_model(fp8, cfg, torch.float32, torch.device("cpu"), 64)
    floats = dict(dense.named_modules())
    num_fp8 = 0
    for path, module in kept.named_modules():
        if isinstance(module, Fp8Linear):
            w = module.weight_fp8
            assert torch.equal(dequantize_block_fp8(w.codes, w.scale, (w.block_n, w.block_k)), floats[path].weight), (
                path
            )
            x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(num_fp8))
            codes, scales = quantize_activation_groups(x, w.block_k)
            x_q = codes.float() * scales.repeat_interleave(w.block_k, dim=1)[:, : module.in_features]  # [3, K]
            assert torch.allclose(module(x), F.linear(x_q, floats[path].weight), rtol=1e-5, atol=1e-6), path
            num_fp8 += 1
        elif isinstance(module, Fp8Experts):
            for ours, theirs in ((module.w13, floats[path].w13), (module.w2, floats[path].w2)):
                assert torch.equal(dequantize_block_fp8(ours.codes, ours.scale, (ours.block_n, ours.block_k)), theirs)
            num_fp8 += 1
    assert num_fp8 >= 2 * cfg.num_layers
    assert isinstance(kept.lm_head, Linear) and all(
        isinstance(m.gate, Linear) for m in kept.modules() if hasattr(m, "top_k")
    )
    logits = _requantized_logits(fp8, None, max_tokens=2)  # the engine loads with keeps_fp8 still patched
    assert logits.shape == (4, cfg.vocab_size) and torch.isfinite(logits).all()
