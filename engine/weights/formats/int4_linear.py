"""Weight-only int4 linears for CPUs (`--quantization int4`, W4A16): float checkpoint weights
quantized at load to 4-bit codes with a scale and a zero point per group of 32 input columns
(asymmetric, GGUF Q4_1's grid), run with bf16 activations by our compiled op (kernels/cpu_int4.cpp)
where this CPU has AVX512-BF16 and the CPU ops are loaded, else by torch's own CPU kernel
`torch._weight_int4pack_mm_for_cpu`; and the builder the loader streams shards into.

Q4_1 stores each block of 32 weights as d * q + m with q in 0..15, d = (max - min) / 15, m = min;
quantizing such weights again with the same rule finds the same d, m and q. So the built-in
SmolLM2 (a Q4_1 GGUF dequantized at load) runs on its own 4-bit grid, up to the bf16 rounding of
d and m (the kernel takes its scales in the activation dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import ConfigError
from engine.weights.formats.int8_linear import Int8Linear
from engine.weights.formats.packed_linear import DenseWeight, QuantizedLinear, can_pack
from engine.weights.formats.shard_checks import FloatQuantizingBuilder
from kernels import cpu_int4
from kernels.cpu_ops import ops_loaded

GROUP_SIZE = 32  # Q4_1's block; the kernel takes 32, 64, 128 or 256
_LEVELS = 15  # codes 0..15
_MIDPOINT = 8  # the kernel computes (code - 8) * scale + zero
_N_MULTIPLE = 16  # the kernel's packing takes whole tiles of 16 output rows
# The activation dtype the int4 path runs (its scales must be the same dtype): the kernel's
# fast path, and the one measured (docs/PERF.md).
INT4_ACTIVATION_DTYPE = torch.bfloat16


def quantize_int4(
    weight: Tensor, dtype: torch.dtype = INT4_ACTIVATION_DTYPE, group_size: int = GROUP_SIZE
) -> tuple[Tensor, Tensor]:
    """[N, K] float weight (K a multiple of `group_size`) -> (codes [N, K] uint8 in 0..15,
    scales_and_zeros [K / group_size, N, 2] in `dtype`): w ~ (code - 8) * scale + zero per group.

    NOTE: scale and zero are rounded to `dtype` first and the codes chosen against the stored
    values, so codes times the stored scale are the nearest grid point the kernel will multiply.
    A constant group gets scale 1 and reproduces its value exactly."""
    n, k = weight.shape
    assert k % group_size == 0, f"K = {k} is not a multiple of the group size {group_size}"
    w = weight.detach().float().reshape(n, k // group_size, group_size)  # [N, G, g]
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
    scale = torch.where(hi > lo, (hi - lo) / _LEVELS, torch.ones_like(hi)).to(dtype)  # [N, G]
    zero = (lo + _MIDPOINT * scale.float()).to(dtype)  # [N, G]: the value of code 8
    base = zero.float() - _MIDPOINT * scale.float()  # [N, G]: the value of code 0, as stored
    codes = torch.round((w - base[..., None]) / scale.float()[..., None]).clamp_(0, _LEVELS).to(torch.uint8)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
    return codes.reshape(n, k), scales_and_zeros


def quantize_padded(weight: Tensor, dtype: torch.dtype = INT4_ACTIVATION_DTYPE) -> tuple[Tensor, Tensor]:
    """`quantize_int4` of [N, K] with K padded by zero columns up to a whole group (an input is
    padded with zeros to match, so the products are unchanged)."""
    pad = -weight.shape[1] % GROUP_SIZE
    return quantize_int4(F.pad(weight.detach().float(), (0, pad)), dtype)


def dequantize_int4(
    codes: Tensor, scales_and_zeros: Tensor, group_size: int = GROUP_SIZE, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The float weight [N, K] an int4 linear multiplies by: (code - 8) * scale + zero, per group."""
    n, k = codes.shape
    scale = scales_and_zeros[..., 0].t().float()  # [N, G]
    zero = scales_and_zeros[..., 1].t().float()  # [N, G]
    q = codes.float().reshape(n, k // group_size, group_size)
    return ((q - _MIDPOINT) * scale[..., None] + zero[..., None]).reshape(n, k).to(dtype)


def own_kernel_ready() -> bool:
    """Whether new int4 linears run our op: the CPU ops are loaded (engine/host/cpu_kernels.py) and
    it has its AVX512-BF16 loop (faster than torch's kernel at one row, docs/PERF.md "The int4
    kernel, ..."); elsewhere torch's kernel stays."""
    return ops_loaded() and cpu_int4.int4_gemv_native()


class Int4Linear(QuantizedLinear):
    """y = x dequantize(codes)^T (+ b), the codes packed two to a byte in the kernel's layout
    (our op's, kernels/cpu_int4.py, or torch's).

    Inputs of at least `dense_from_rows` rows multiply a dense copy of the same dequantized weight
    instead (a GEMM: torch's int4 kernel is a matrix-vector kernel whose time grows with the rows,
    docs/PERF.md)."""

    def __init__(
        self,
        codes: Tensor,
        scales_and_zeros: Tensor,
        bias: Tensor | None,
        in_features: int | None = None,
        dense_from_rows: int = 0,
        group_size: int = GROUP_SIZE,
        source: Tensor | None = None,
        own_kernel: bool | None = None,
    ) -> None:
        """`codes` [N, K] and `scales_and_zeros` as `quantize_int4` gives them; `in_features`: the
        layer's real K when `codes` carry zero padding columns up to a whole group; `dense_from_rows`
        > 0 keeps a dense bf16 copy for inputs of that many rows or more: of `source` ([N, K] float,
        the checkpoint's weights the codes were quantized from) when given, else of the codes.

        NOTE: from the checkpoint's weights, large inputs (prefills) see what `--dtype bfloat16`
        would: on SmolLM2 the defaults' perplexity went from +0.34% to +0.22% against float32
        (docs/PERF.md), and its greedy answer to a short question is bf16's again.
        `own_kernel`: run our op (True) or torch's kernel (False); None: `own_kernel_ready()`."""
        super().__init__()
        assert codes.dtype == torch.uint8 and codes.dim() == 2, f"uint8 [N, K] codes expected, got {codes.dtype}"
        n, k = codes.shape
        assert k % group_size == 0, f"K = {k} is not a multiple of the group size {group_size}"
        assert scales_and_zeros.shape == (k // group_size, n, 2), "one scale and zero per row and group"
        self.out_features, self.in_features = n, k if in_features is None else in_features
        assert k - GROUP_SIZE < self.in_features <= k, f"in_features {in_features} for {k} columns of codes"
        self.group_size = group_size
        self.k_pad = k - self.in_features  # zero columns the input gets (K up to a whole group)
        self.own_kernel = own_kernel_ready() if own_kernel is None else own_kernel
        if self.own_kernel and group_size == cpu_int4.GROUP and scales_and_zeros.dtype == torch.bfloat16:
            # [N, Kp / 2] uint8 and [N, Kp / 32, 2]: our op's layout; it takes x with K columns as they are.
            packed, sz = cpu_int4.pack_int4_codes(codes, scales_and_zeros)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", sz)
        else:
            self.own_kernel = False
            # NOTE: torch's kernel takes N in multiples of 16: extra rows of code 0 and scale/zero 0
            # give zero outputs, cut off after the call (real models' widths never pad).
            row_pad = -n % _N_MULTIPLE
            padded_codes = F.pad(codes, (0, 0, 0, row_pad)).to(torch.int32)  # [N + pad, K]
            # [N + pad, K / 2] uint8 in the kernel's layout (packed with innerKTiles=1, its CPU layout).
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded_codes, 1))
            # [K / group, N + pad, 2] activation dtype
            self.register_buffer("scales_and_zeros", F.pad(scales_and_zeros, (0, 0, 0, row_pad)))
        self.register_buffer("bias", bias)  # [N] activation dtype, or None
        # Optional: the dequantized weight (engine/weights/formats/packed_linear.py's DenseWeight), for inputs of at
        # least `dense_from_rows` rows.
        self.dense: DenseWeight | None = None
        self.dense_from_rows = dense_from_rows
        if dense_from_rows:
            weight = source if source is not None else dequantize_int4(codes, scales_and_zeros, group_size)
            self.dense = DenseWeight(weight[:, : self.in_features], scales_and_zeros.dtype)  # [N, K]

    @staticmethod
    def from_float(
        weight: Tensor,
        bias: Tensor | None,
        dtype: torch.dtype = INT4_ACTIVATION_DTYPE,
        dense_from_rows: int = 0,
        own_kernel: bool | None = None,
    ) -> Int4Linear:
        codes, sz = quantize_padded(weight, dtype)
        return Int4Linear(
            codes,
            sz,
            None if bias is None else bias.detach().to(dtype),
            weight.shape[1],
            dense_from_rows,
            source=weight if dense_from_rows else None,
            own_kernel=own_kernel,
        )

    @property
    def weight_nbytes(self) -> int:
        """The packed codes, scales and zeros (not a dense copy: `dense_nbytes`)."""
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def quantized_mm(self, x2: Tensor) -> Tensor:
        if self.own_kernel:
            return cpu_int4.int4_gemv(x2 if x2.stride(-1) == 1 else x2.contiguous(), self.packed, self.scales_and_zeros)
        if self.k_pad:
            x2 = F.pad(x2, (0, self.k_pad))  # [T, K + pad], a new contiguous tensor
        elif not x2.is_contiguous():
            x2 = x2.contiguous()
        y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features].contiguous()  # [T, N]: the padding rows' zeros cut off
        return y

    def kernel_weights(self) -> tuple[Tensor, Tensor, int] | None:
        """(packed codes, scales and zeros, rows from which the dense copy serves) for a caller that
        runs the kernel itself (kernels/cpu_decode_layer.cpp, our op or torch's as `own_kernel`
        says); None where `quantized_mm` does more than call it (padding columns or rows for
        torch's kernel, a bias)."""
        if self.bias is not None:
            return None
        if not self.own_kernel and (self.k_pad or self.scales_and_zeros.shape[1] != self.out_features):
            return None
        return self.packed, self.scales_and_zeros, self.dense_from_rows if self.dense is not None else 0

    def format_repr(self) -> str:
        return f"int4 groups of {self.group_size}" + (" (our kernel)" if self.own_kernel else "")


def cpu_streamed_weights(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, buffer name) of what a CPU decode step reads whole at one row, in the order it reads
    them: each int4 linear's packed codes and scales/zeros, then an int8 lm_head's codes (for
    engine/host/huge_pages.py)."""
    found: list[tuple[nn.Module, str]] = []
    for module in model.modules():
        if isinstance(module, Int4Linear):
            found += [(module, "packed"), (module, "scales_and_zeros")]
    head = getattr(model, "lm_head", None)
    if isinstance(head, Int8Linear):
        found.append((head, "codes"))
    return found


def check_int4_device(device: torch.device, dtype: torch.dtype) -> None:
    """int4 runs on CPU with bf16 activations only (the kernel's fast path, the one measured)."""
    if device.type != "cpu":
        raise ConfigError(
            f"--quantization int4: CPU only (the device is {device.type}); on a GPU use "
            "--quantization nvfp4 or a float dtype"
        )
    if dtype != INT4_ACTIVATION_DTYPE:
        raise ConfigError(
            f"--quantization int4 runs bfloat16 activations; --dtype "
            f"{str(dtype).removeprefix('torch.')} is not supported with it (use --dtype auto)"
        )


class Int4LinearBuilder(FloatQuantizingBuilder):
    """One int4 linear from float checkpoint tensors; `build` once all have arrived. Groups run along
    each row, so fusing is exact."""

    scheme = "int4"

    def __init__(
        self,
        hf_modules: list[str],
        shard_sizes: list[int],
        in_features: int,
        bias: Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        dense_from_rows: int = 0,
    ) -> None:
        super().__init__(hf_modules, shard_sizes, in_features, bias, dtype, device)
        self.dense_from_rows = dense_from_rows
        # With a dense copy: each shard's checkpoint weight ([rows, K]), the copy's source.
        self.sources: list[Tensor | None] = [None] * len(shard_sizes)

    def quantize(self, shard: int, weight: Tensor) -> tuple[Tensor, Tensor]:
        if self.dense_from_rows:  # the dtype the dense copy will hold (DenseWeight: bf16 where packed)
            self.sources[shard] = weight.to(torch.bfloat16 if can_pack(self.dtype, self.device) else torch.float32)
        return quantize_padded(weight, self.dtype)  # (codes, scales and zeros)

    def build(self) -> Int4Linear:
        shards = self.complete_shards()
        codes = torch.cat([c for c, _ in shards])  # [N, K (+ pad)] uint8
        sz = torch.cat([z for _, z in shards], dim=1)  # [K / group, N, 2]
        source = torch.cat([w for w in self.sources if w is not None]) if self.dense_from_rows else None  # [N, K]
        return Int4Linear(codes, sz, self.bias, self.in_features, self.dense_from_rows, source=source)
