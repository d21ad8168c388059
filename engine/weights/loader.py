"""Weights from a local HF checkpoint (one safetensors file or a sharded index) straight into
our modules, tensor by tensor: float; NVFP4 linears packed in the checkpoint or quantized here;
int8 at load; block-wise FP8 kept as FP8 on GPUs with FP8 tensor cores or dequantized as it streams
(engine/weights/formats/fp8.py); and the MTP head, from the checkpoint or a second folder
(engine/weights/mtp_source.py).
A missing or mis-shaped tensor fails start-up with one line naming it."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from engine.errors import ConfigError
from engine.models.decoder import DecoderForCausalLM, make_mlp
from engine.models.layers import Linear, RotaryEmbedding
from engine.models.moe import NVFP4Experts
from engine.models.qwen3_5 import HybridForCausalLM
from engine.models.qwen3_5_mtp import MTP_PREFIX, Qwen3_5MTP, map_mtp_name
from engine.weights.checkpoint_files import checkpoint_files, iter_checkpoint, tensor_names
from engine.weights.config.model_config import ModelConfig
from engine.weights.formats.fp8 import Fp8Dequantizer, Fp8Format, fp8_format, keeps_fp8
from engine.weights.formats.int4_linear import Int4Linear, check_int4_device
from engine.weights.formats.int8_linear import Int8Linear, check_int8_device, quantize_int8
from engine.weights.formats.nvfp4 import CPU_SCHEMES, INT4, INT8, LINEAR_SUFFIXES, QuantizationMethod, tensor_roles
from engine.weights.linear_plan import LinearBuilder, Unloaded, hf_name, plan_linears
from engine.weights.moe_loader import ExpertLoader, map_moe_name
from engine.weights.mtp_source import MtpSource
from engine.weights.qwen3_5_names import LINEAR_ATTN_RULES, canonical_name, skipped_part
from kernels.fp8_dispatch import Fp8Experts, Fp8Linear
from kernels.nvfp4_matmul import NVFP4Linear

logger = logging.getLogger("fp4serve.loader")
_MIB = 1 << 20

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
    total: int  # every resident weight tensor, tied ones once, NVFP4 and FP8 scales included
    nvfp4: int  # of which the NVFP4 linears' (and experts') packed codes and scales
    num_nvfp4_linears: int
    fp8: int = 0  # of which the FP8 linears' (and experts') codes and block scales
    num_fp8_linears: int = 0


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Resident weight bytes (not the rotary tables, which are derived, not loaded)."""
    # NOTE: NVFP4 operands and FP8 weights are deliberately no buffers, so state_dict misses them.
    tensors = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}
    nvfp4 = [m for m in model.modules() if isinstance(m, (NVFP4Linear, NVFP4Experts))]
    fp8 = [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts))]
    nvfp4_bytes = sum(m.weight_nbytes for m in nvfp4)
    fp8_bytes = sum(m.weight_nbytes for m in fp8)
    return WeightBytes(sum(tensors.values()) + nvfp4_bytes + fp8_bytes, nvfp4_bytes, len(nvfp4), fp8_bytes, len(fp8))


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


def _materialize(model: DecoderForCausalLM, built_paths: list[str], device: torch.device, max_len: int) -> None:
    """Uninitialized float tensors on `device` (the checkpoint fills them); placeholders for built linears."""
    for module_path in built_paths:
        parent, _, child = module_path.rpartition(".")
        setattr(model.get_submodule(parent), child, Unloaded())
    # NOTE: `model.to_empty` would run torch.empty_like on meta tensors, whose Python decomposition
    # imports sympy on first use: seconds of every engine start. The same storage, strides kept:
    model._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))
    cfg = model.config
    # NOTE: the meta build left the derived cos/sin tables without values: compute them.
    with torch.device(device):
        model.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings, max_len)
    assert model.rotary.cos.dtype == torch.float32, "cos/sin tables stay float32, cast at use"
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def _expected_tensors(
    params: dict[str, nn.Parameter], modules: dict[str, nn.Module], cfg: ModelConfig
) -> set[tuple[str, int | None]]:
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


@dataclass
class _Sink:
    """Where each (canonical) checkpoint tensor goes: the expert loader, a builder, or a float
    parameter; what was seen, skipped or unused."""

    model: DecoderForCausalLM
    dtype: torch.dtype
    experts: ExpertLoader
    pending: dict[str, LinearBuilder]
    skipped_suffixes: tuple[str, ...]  # W4A4 activation scales of packed NVFP4 linears
    head_source: str | None  # int8: the parameter whose stored values become the int8 lm_head
    params: dict[str, nn.Parameter] = field(init=False)
    modules: dict[str, nn.Module] = field(init=False)
    seen: set[tuple[str, int | None]] = field(default_factory=set)
    unused: list[str] = field(default_factory=list)
    num_skipped: int = 0
    head_int8: tuple[torch.Tensor, torch.Tensor] | None = None  # (codes [V, H] int8, scales [V])

    def __post_init__(self) -> None:
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self.modules = dict(self.model.named_modules())

    def put(self, name: str, tensor: torch.Tensor) -> None:
        cfg = self.model.config
        if self.experts.add(name, tensor):
            return
        mapped = map_mtp_name(name, map_name) if name.startswith(MTP_PREFIX) else map_name(name)
        if mapped is None or (mapped[0].startswith("lm_head.") and cfg.tie_word_embeddings):
            self.unused.append(name)
            return
        pname, shard = mapped
        module_path, _, leaf = pname.rpartition(".")
        if module_path in self.pending and leaf in self.skipped_suffixes:
            self.num_skipped += 1  # W4A4 activation scales: NVFP4 runs weight-only here
            return
        if module_path in self.pending:
            assert shard is not None, f"{name}: a linear's tensor without a shard"
            self.pending[module_path].add(shard, leaf, tensor)
            return
        if leaf not in ("weight", "bias") and isinstance(self.modules.get(module_path), Linear):
            self.unused.append(name)  # a quantization tensor of a linear the checkpoint keeps in float
            return
        if pname not in self.params:
            raise ConfigError(f"tensor '{name}' does not fit this model's configuration")
        target = self.params[pname]
        if shard is not None:
            module = self.modules[module_path]
            assert isinstance(module, Linear)
            target = target[module.shard_slice(shard)]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ConfigError(f"tensor '{name}' has shape {list(tensor.shape)}, expected {list(target.shape)}")
        target.copy_(tensor.to(self.dtype))
        self.seen.add((pname, shard))
        if pname == self.head_source:
            self.head_int8 = quantize_int8(tensor, self.dtype)  # from the stored values, not the dtype copy


def load_model(
    path: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    quantization: QuantizationMethod | None = None,
    mtp: bool = False,
    mtp_path: Path | None = None,
) -> DecoderForCausalLM:
    """`mtp`: load an MTP head too (`model.mtp`, --speculative-method mtp): the checkpoint's mtp.*
    tensors, or those of `mtp_path` (--speculative-model), whose body is not read."""
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
    fp8 = fp8_format(cfg.quantization)
    keep_fp8 = fp8 if fp8 is not None and keeps_fp8(fp8, device, requantized=quantization is not None) else None
    files = checkpoint_files(path)
    names = [canonical_name(n) for n in tensor_names(files)]  # ConditionalGeneration: text model as model.*
    num_tensors = len(names)
    source = MtpSource.open(mtp_path, cfg) if mtp and mtp_path is not None else None
    if source is not None:
        names = [n for n in names if not n.startswith(MTP_PREFIX)] + list(source.names)
    num_mtp = sum(n.startswith(MTP_PREFIX) for n in names)
    if mtp and not num_mtp:
        raise ConfigError(
            f"--speculative-method mtp: {path} has no mtp.* tensors (this checkpoint carries no MTP "
            "head); take one from another checkpoint of the model with --speculative-model PATH, "
            "or use --speculative-method ngram"
        )
    model = _meta_model(cfg, dtype, max_len, mtp)
    pending = plan_linears(model, set(names), quantization, dtype, device, keep_fp8)
    # NOTE: routed experts stay in the model dtype under int8 (no int8 expert kernel here).
    experts = ExpertLoader(model, set(names), None if int8 else quantization, dtype, device, keep_fp8)
    _materialize(model, list(pending), device, max_len)
    sink = _Sink(
        model,
        dtype,
        experts,
        pending,
        tensor_roles(quantization.checkpoint_format)[1] if quantization and quantization.checkpoint_format else (),
        head_source,
    )
    expected = {e for e in _expected_tensors(sink.params, sink.modules, cfg) if e[0] not in experts.float_param_paths()}
    dequantizer = None
    if fp8 is not None:
        kept = {hf for b in pending.values() for hf in b.hf_modules} if keep_fp8 is not None else set()
        dequantizer = Fp8Dequantizer(fp8, lambda n: n.rpartition(".")[0] in kept or experts.keeps_fp8(n))
    left_out: dict[str, list[str]] = {}  # "vision" | "mtp" -> tensor names a text server does not load
    with torch.no_grad():
        try:
            for name, tensor in tqdm(
                iter_checkpoint(path), total=num_tensors, desc="loading weights", unit="tensor", disable=None
            ):
                part = skipped_part(name)
                if part is not None and not (part == "mtp" and mtp and source is None):
                    left_out.setdefault(part, []).append(name)
                    continue
                name = canonical_name(name)
                for placed, value in dequantizer.feed(name, tensor) if dequantizer else ((name, tensor),):
                    sink.put(placed, value)
            if dequantizer is not None:
                dequantizer.finish()
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        if source is not None:
            try:
                for name, tensor in tqdm(
                    source.tensors(), total=source.num_tensors, desc="loading MTP head", unit="tensor", disable=None
                ):
                    sink.put(name, tensor)
            except ConfigError as e:
                message = str(e)
                raise ConfigError(
                    message
                    if message.startswith("--speculative-model")
                    else f"--speculative-model {source.path}: {message}"
                ) from None
    _finish(model, path, sink, expected, experts, pending)
    if sink.head_int8 is not None:
        bias = model.lm_head.bias
        model.lm_head = Int8Linear(*sink.head_int8, None if bias is None else bias.detach().clone())
    if int8:
        if quantization is not None and quantization.int8_dense_from_rows:
            for m in model.modules():
                if isinstance(m, Int8Linear):
                    m.keep_dense_copy(quantization.int8_dense_from_rows)
        _log_int8(model, dtype)
    if sink.num_skipped:
        skipped = "/".join(sink.skipped_suffixes)
        logger.info(
            "skipped %d W4A4 activation scales (%s): weight-only NVFP4, activations stay in %s",
            sink.num_skipped,
            skipped,
            str(dtype).removeprefix("torch."),
        )
    _log_left_out(left_out)
    if fp8 is not None:
        _log_fp8(model, fp8, keep_fp8 is not None, quantization, dtype, device, dequantizer)
    if mtp:
        where = (
            f"from {source.path}{' (FP8, dequantized)' if source.fp8 else ''}; the body's own mtp.* unread"
            if source is not None
            else "from the checkpoint"
        )
        logger.info(
            "MTP head loaded: %d mtp.* tensors %s (fc, 1 gated-attention layer, norms; embedding and lm_head "
            "shared with the main model)",
            num_mtp,
            where,
        )
    if sink.unused:
        logger.warning("ignored %d checkpoint tensors (e.g. %s)", len(sink.unused), sink.unused[0])
    return model.eval()


def _finish(
    model: DecoderForCausalLM,
    path: Path,
    sink: _Sink,
    expected: set[tuple[str, int | None]],
    experts: ExpertLoader,
    pending: dict[str, LinearBuilder],
) -> None:
    """Fail on the first missing tensor; put the built linears and experts in place."""
    missing = sorted(expected - sink.seen, key=str)
    if missing:
        pname, shard = missing[0]
        where = "--speculative-model" if pname.startswith(MTP_PREFIX) else str(path)
        raise ConfigError(f"{where}: missing tensor for '{hf_name(pname, shard)}' ({len(missing)} missing in all)")
    try:
        experts.finish()
        for module_path, builder in pending.items():
            parent, _, child = module_path.rpartition(".")
            setattr(model.get_submodule(parent), child, builder.build())
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _log_fp8(
    model: nn.Module,
    fmt: Fp8Format,
    kept: bool,
    quantization: QuantizationMethod | None,
    dtype: torch.dtype,
    device: torch.device,
    dequantizer: Fp8Dequantizer | None,
) -> None:
    """One line: the checkpoint's format, what became of it, and the resident bytes."""
    footprint = weight_bytes(model)
    name = str(dtype).removeprefix("torch.")
    if kept:
        what = (
            f"{footprint.num_fp8_linears} linears and expert blocks kept in FP8 on {device} (W8A8: activations "
            f"quantized per token and group of {fmt.block[1]}); {footprint.fp8 / _MIB:.2f} MiB of e4m3 codes "
            "and block scales"
        )
    elif quantization is not None:
        what = f"dequantized at load and re-quantized ({quantization.describe()})"
    else:
        why = "this device has no FP8 tensor cores" if device.type != "cpu" else "CPU"
        what = f"dequantized at load to {name} ({why})"
    count = dequantizer.num_dequantized if dequantizer is not None else 0
    logger.info(
        "checkpoint format: %s; %s; %d FP8 tensors dequantized; weights resident: %.2f MiB",
        fmt.describe(),
        what,
        count,
        footprint.total / _MIB,
    )


def _log_left_out(left_out: dict[str, list[str]]) -> None:
    """One start-up line per part of a checkpoint this text server does not load."""
    vision, mtp = left_out.get("vision", []), left_out.get("mtp", [])
    if vision:
        logger.info(
            "skipped %d vision tensors (model.visual.*, e.g. %s): this server serves text", len(vision), vision[0]
        )
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
    logger.info(
        "%s: %d linears quantized at load (%.2f MiB of %s codes and scales; %s); activations in %s; "
        "embeddings and norms stay in %s",
        scheme,
        len(linears),
        nbytes / (1 << 20),
        scheme,
        head,
        name,
        name,
    )
    dense = sum(m.dense_nbytes for m in linears)
    if dense:
        what = "checkpoint's weights" if scheme == "int4" else "dequantized weights"
        logger.info(
            "%s: inputs of %d rows or more (prefill, large batches) multiply a dense %s copy of the "
            "%s (%.2f MiB more), faster there than the %s kernel",
            scheme,
            linears[0].dense_from_rows,
            name,
            what,
            dense / (1 << 20),
            scheme,
        )
