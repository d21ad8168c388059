"""Weights from a local HF checkpoint (one safetensors file or a sharded index) straight into
our modules: float, or NVFP4 linears packed in the checkpoint or quantized here. A missing or
mis-shaped tensor fails start-up with one line naming it."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from engine.config import ConfigError, ModelConfig
from engine.models.decoder import DecoderForCausalLM, make_mlp
from engine.models.layers import Linear, RotaryEmbedding
from engine.models.qwen3_5 import HybridForCausalLM
from engine.models.qwen3_5_mtp import MTP_PREFIX, Qwen3_5MTP, map_mtp_name
from engine.models.qwen3_5_weights import FUSED_LINEARS, LINEAR_ATTN_RULES, canonical_name, skipped_part
from engine.models.moe import NVFP4Experts
from engine.moe_loader import ExpertLoader, map_moe_name
from engine.int4_linear import Int4Linear, Int4LinearBuilder, check_int4_device
from engine.int8_linear import Int8Linear, Int8LinearBuilder, check_int8_device, quantize_int8
from engine.quantization import (
    CPU_SCHEMES,
    INT4,
    INT8,
    LINEAR_SUFFIXES,
    NVFP4LinearBuilder,
    QuantizationMethod,
    check_quantizable,
    is_packed,
    is_quantizable,
    tensor_roles,
)
from kernels.nvfp4_matmul import NVFP4Linear

logger = logging.getLogger("fp4serve.loader")

_LINEAR = "(" + "|".join(LINEAR_SUFFIXES) + ")"
# HF tensor name -> (our parameter path, shard index within a fused Linear or None)
_LAYER_RULES: list[tuple[re.Pattern[str], str, int | None]] = [
    (re.compile(rf"self_attn\.q_proj\.{_LINEAR}$"), "self_attn.qkv_proj.{0}", 0),
    (re.compile(rf"self_attn\.k_proj\.{_LINEAR}$"), "self_attn.qkv_proj.{0}", 1),
    (re.compile(rf"self_attn\.v_proj\.{_LINEAR}$"), "self_attn.qkv_proj.{0}", 2),
    (re.compile(rf"self_attn\.o_proj\.{_LINEAR}$"), "self_attn.o_proj.{0}", 0),
    (re.compile(rf"mlp\.gate_proj\.{_LINEAR}$"), "mlp.gate_up_proj.{0}", 0),
    (re.compile(rf"mlp\.up_proj\.{_LINEAR}$"), "mlp.gate_up_proj.{0}", 1),
    (re.compile(rf"mlp\.down_proj\.{_LINEAR}$"), "mlp.down_proj.{0}", 0),
    (re.compile(r"self_attn\.q_norm\.weight$"), "self_attn.q_norm.weight", None),
    (re.compile(r"self_attn\.k_norm\.weight$"), "self_attn.k_norm.weight", None),
    (re.compile(r"input_layernorm\.weight$"), "input_layernorm.weight", None),
    (re.compile(r"post_attention_layernorm\.weight$"), "post_attention_layernorm.weight", None),
]
_LM_HEAD = re.compile(rf"lm_head\.{_LINEAR}$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{index}: shard {f.name} not found")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors weights found")
    return files


def tensor_names(files: list[Path]) -> list[str]:
    """Every tensor name in the checkpoint, read from the safetensors headers only."""
    names: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.extend(st.keys())
    return names


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = checkpoint_files(path)
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def map_name(name: str) -> tuple[str, int | None] | None:
    """HF tensor name -> (our parameter path, shard) or None for tensors we do not use."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    head = _LM_HEAD.fullmatch(name)
    if head is not None:
        return f"lm_head.{head.group(1)}", 0
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if m is None or _IGNORED.search(name):
        return None
    layer, rest = m.group(1), m.group(2)
    for pattern, target, shard in (*_LAYER_RULES, *LINEAR_ATTN_RULES):
        pm = pattern.search(rest)
        if pm is not None:
            return f"layers.{layer}." + target.format(*pm.groups()), shard
    moe = map_moe_name(rest)  # a MoE block's router and shared expert (experts: ExpertLoader)
    return None if moe is None else (f"layers.{layer}.{moe[0]}", moe[1])


@dataclass(frozen=True)
class WeightBytes:
    total: int  # every resident weight tensor, tied ones once, NVFP4 scales included
    nvfp4: int  # of which the NVFP4 linears' packed codes and scales
    num_nvfp4_linears: int


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Resident weight bytes (not the rotary tables, which are derived, not loaded)."""
    # NOTE: an NVFP4Linear's prepared operand is deliberately no buffer, so state_dict misses it.
    tensors = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}
    linears = [m for m in model.modules() if isinstance(m, (NVFP4Linear, NVFP4Experts))]
    nvfp4 = sum(m.weight_nbytes for m in linears)
    return WeightBytes(sum(tensors.values()) + nvfp4, nvfp4, len(linears))


class _Unloaded(nn.Module):
    """Holds an NVFP4 linear's place until its shards have all streamed in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("an NVFP4 linear was used before the loader finished it")


def _nvfp4_plan(model: DecoderForCausalLM, names: set[str], method: QuantizationMethod | None,
                dtype: torch.dtype, device: torch.device) -> dict[str, NVFP4LinearBuilder | Int8LinearBuilder | Int4LinearBuilder]:
    """Which of the model's Linears are quantized: for a packed checkpoint, those whose tensors say
    so (exclude lists vary between producers; the tensors do not lie); at load (NVFP4 or int8),
    q/k/v/o, gate/up/down."""
    if method is None:
        return {}
    cfg = model.config
    if method.quantize_at_load and method.scheme not in CPU_SCHEMES:
        check_quantizable(cfg, "--quantization nvfp4")
    plan: dict[str, NVFP4LinearBuilder | Int8LinearBuilder | Int4LinearBuilder] = {}
    for module_path, module in model.named_modules():
        if not isinstance(module, Linear) or (module_path == "lm_head" and cfg.tie_word_embeddings):
            continue
        hf = [_hf_name(f"{module_path}.weight", i).removesuffix(".weight") for i in range(len(module.shard_sizes))]
        fmt = method.checkpoint_format
        flags = [is_quantizable(h) if fmt is None else is_packed(fmt, names, h) for h in hf]
        if any(flags) and not all(flags):
            raise ConfigError(f"{hf[flags.index(True)]} is NVFP4 but {hf[flags.index(False)]} is not; "
                              f"the linears fused into {module_path} need one format")
        if all(flags):
            bias = None
            if module.bias is not None:
                bias = torch.zeros(sum(module.shard_sizes), dtype=dtype, device=device)  # [N]
            if method.scheme == INT8:
                plan[module_path] = Int8LinearBuilder(hf, module.shard_sizes, module.in_features, bias, dtype, device)
            elif method.scheme == INT4:
                plan[module_path] = Int4LinearBuilder(hf, module.shard_sizes, module.in_features, bias, dtype, device,
                                                      method.int8_dense_from_rows)
            else:
                plan[module_path] = NVFP4LinearBuilder(method, hf, module.shard_sizes, module.in_features, bias,
                                                       device)
    return plan


def _meta_model(cfg: ModelConfig, dtype: torch.dtype, max_len: int, mtp: bool = False) -> DecoderForCausalLM:
    """The model without storage, so a linear that becomes NVFP4 never allocates a float weight.
    `mtp`: with the checkpoint's MTP head as `model.mtp` (a hybrid model's)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            if cfg.hybrid is not None:
                model = HybridForCausalLM(cfg, max_len, mlp_factory=make_mlp)  # Qwen3.5-MoE: SparseMoeBlock
                if mtp:
                    model.mtp = Qwen3_5MTP(cfg, make_mlp)
                return model
            assert not mtp, "an MTP head needs a Qwen3.5 hybrid"
            return DecoderForCausalLM(cfg, max_len)
    finally:
        torch.set_default_dtype(default_dtype)


def _materialize(model: DecoderForCausalLM, nvfp4_paths: list[str], device: torch.device, max_len: int) -> None:
    """Uninitialized float tensors on `device` (the checkpoint fills them); placeholders for NVFP4 linears."""
    for module_path in nvfp4_paths:
        parent, _, child = module_path.rpartition(".")
        setattr(model.get_submodule(parent), child, _Unloaded())
    model.to_empty(device=device)
    cfg = model.config
    # NOTE: the meta build left the derived cos/sin tables without values: compute them.
    with torch.device(device):
        model.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings, max_len)
    assert model.rotary.cos.dtype == torch.float32, "cos/sin tables stay float32, cast at use"
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def _expected_tensors(params: dict[str, nn.Parameter], modules: dict[str, nn.Module],
                      cfg: ModelConfig) -> set[tuple[str, int | None]]:
    """(parameter path, shard) of every float tensor the checkpoint must provide."""
    expected: set[tuple[str, int | None]] = set()
    for pname in params:
        module = modules[pname.rpartition(".")[0]]
        if isinstance(module, Linear):
            if pname == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            expected.update((pname, i) for i in range(len(module.shard_sizes)))
        else:
            expected.add((pname, None))
    return expected


def load_model(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int,
               quantization: QuantizationMethod | None = None, mtp: bool = False) -> DecoderForCausalLM:
    """`mtp`: load the checkpoint's mtp.* head too (`model.mtp`, --speculative-method mtp)."""
    int8 = quantization is not None and quantization.scheme in CPU_SCHEMES  # int8 or int4
    if quantization is not None and quantization.scheme == INT8:
        check_int8_device(device)
    if quantization is not None and quantization.scheme == INT4:
        check_int4_device(device, dtype)
    # int8/int4 lm_head: an int8 copy of the head's weight (the tied embedding stays float). int4
    # quantizes its head to int8 too: 4 bits cost the head far more than the layers (docs/PERF.md).
    head_source = None
    if int8 and quantization is not None and quantization.int8_lm_head:
        head_source = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head_int8: tuple[torch.Tensor, torch.Tensor] | None = None  # (codes [V, H] int8, scales [V])
    files = checkpoint_files(path)
    names = [canonical_name(n) for n in tensor_names(files)]  # ConditionalGeneration: text model as model.*
    num_mtp = sum(n.startswith(MTP_PREFIX) for n in names)
    if mtp and not num_mtp:
        raise ConfigError(f"--speculative-method mtp: {path} has no mtp.* tensors (this checkpoint carries no MTP "
                          "head); use --speculative-method ngram")
    model = _meta_model(cfg, dtype, max_len, mtp)
    pending = _nvfp4_plan(model, set(names), quantization, dtype, device)
    # NOTE: routed experts stay in the model dtype under int8 (no int8 expert kernel here).
    experts = ExpertLoader(model, set(names), None if int8 else quantization, dtype, device)
    _materialize(model, list(pending), device, max_len)
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    expected = {e for e in _expected_tensors(params, modules, cfg) if e[0] not in experts.float_param_paths()}
    skipped = tensor_roles(quantization.checkpoint_format)[1] if quantization and quantization.checkpoint_format else ()
    seen: set[tuple[str, int | None]] = set()
    unused: list[str] = []
    num_skipped = 0
    left_out: dict[str, list[str]] = {}  # "vision" | "mtp" -> tensor names a text server does not load
    with torch.no_grad():
        for name, tensor in tqdm(iter_checkpoint(path), total=len(names), desc="loading weights", unit="tensor",
                                 disable=None):
            part = skipped_part(name)
            if part is not None and not (part == "mtp" and mtp):
                left_out.setdefault(part, []).append(name)
                continue
            name = canonical_name(name)
            try:
                if experts.add(name, tensor):
                    continue
            except ConfigError as e:
                raise ConfigError(f"{path}: {e}") from None
            mapped = map_mtp_name(name, map_name) if name.startswith(MTP_PREFIX) else map_name(name)
            if mapped is None or (mapped[0].startswith("lm_head.") and cfg.tie_word_embeddings):
                unused.append(name)
                continue
            pname, shard = mapped
            module_path, _, leaf = pname.rpartition(".")
            if module_path in pending and leaf in skipped:
                num_skipped += 1  # W4A4 activation scales: NVFP4 runs weight-only here
                continue
            if module_path in pending:
                assert shard is not None, f"{name}: a linear's tensor without a shard"
                try:
                    pending[module_path].add(shard, leaf, tensor)
                except ConfigError as e:
                    raise ConfigError(f"{path}: {e}") from None
                continue
            if leaf not in ("weight", "bias") and isinstance(modules.get(module_path), Linear):
                unused.append(name)  # a quantization tensor of a linear the checkpoint keeps in float
                continue
            if pname not in params:
                raise ConfigError(f"{path}: tensor '{name}' does not fit this model's configuration")
            target = params[pname]
            if shard is not None:
                module = modules[module_path]
                assert isinstance(module, Linear)
                target = target[module.shard_slice(shard)]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ConfigError(f"{path}: tensor '{name}' has shape {list(tensor.shape)}, expected {list(target.shape)}")
            target.copy_(tensor.to(dtype))
            seen.add((pname, shard))
            if pname == head_source:
                head_int8 = quantize_int8(tensor, dtype)  # from the stored values, not the dtype copy
    missing = sorted(expected - seen, key=str)
    if missing:
        pname, shard = missing[0]
        raise ConfigError(f"{path}: missing tensor for '{_hf_name(pname, shard)}' ({len(missing)} missing in all)")
    try:
        experts.finish()
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    for module_path, builder in pending.items():
        try:
            finished = builder.build()
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        parent, _, child = module_path.rpartition(".")
        setattr(model.get_submodule(parent), child, finished)
    if head_int8 is not None:
        bias = model.lm_head.bias
        model.lm_head = Int8Linear(*head_int8, None if bias is None else bias.detach().clone())
    if int8:
        if quantization is not None and quantization.int8_dense_from_rows:
            for m in model.modules():
                if isinstance(m, Int8Linear):
                    m.keep_dense_copy(quantization.int8_dense_from_rows)
        _log_int8(model, dtype)
    if num_skipped:
        logger.info("skipped %d W4A4 activation scales (%s): weight-only NVFP4, activations stay in %s",
                    num_skipped, "/".join(skipped), str(dtype).removeprefix("torch."))
    _log_left_out(left_out)
    if mtp:
        logger.info("MTP head loaded: %d mtp.* tensors (fc, 1 gated-attention layer, norms; embedding and lm_head "
                    "shared with the main model)", num_mtp)
    if unused:
        logger.warning("ignored %d checkpoint tensors (e.g. %s)", len(unused), unused[0])
    return model.eval()


def _hf_name(pname: str, shard: int | None) -> str:
    """Our parameter path back to the checkpoint's tensor name, for error messages."""
    fused = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        **FUSED_LINEARS,
    }
    name = pname
    for ours, theirs in fused.items():
        if ours in name and shard is not None:
            name = name.replace(ours, theirs[shard])
    if name.startswith(("layers.", "embed_tokens.", "norm.")):
        name = "model." + name
    return name


def _log_left_out(left_out: dict[str, list[str]]) -> None:
    """One start-up line per part of a checkpoint this text server does not load."""
    vision, mtp = left_out.get("vision", []), left_out.get("mtp", [])
    if vision:
        logger.info("skipped %d vision tensors (model.visual.*, e.g. %s): this server serves text", len(vision), vision[0])
    if mtp:
        logger.info("skipped %d MTP tensors (mtp.*): not loaded until speculative decoding uses them", len(mtp))


def _log_int8(model: nn.Module, dtype: torch.dtype) -> None:
    """One start-up line for the int8 or int4 linears, one more for their dense copies."""
    linears = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    scheme = "int4" if isinstance(linears[0], Int4Linear) else "int8"
    nbytes = sum(m.weight_nbytes for m in linears)
    name = str(dtype).removeprefix("torch.")
    head = "lm_head stays float"
    if isinstance(getattr(model, "lm_head", None), Int8Linear):
        head = "lm_head int8 too" if scheme == "int8" else "lm_head int8 (4 bits cost it more than the layers)"
    logger.info("%s: %d linears quantized at load (%.2f MiB of %s codes and scales; %s); activations in %s; "
                "embeddings and norms stay in %s", scheme, len(linears), nbytes / (1 << 20), scheme, head, name, name)
    dense = sum(m.dense_nbytes for m in linears)
    if dense:
        logger.info("%s: inputs of %d rows or more (prefill, large batches) multiply a dense %s copy of the "
                    "dequantized weights (%.2f MiB more), faster there than the %s kernel", scheme,
                    linears[0].dense_from_rows, name, dense / (1 << 20), scheme)
