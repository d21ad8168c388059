"""Weight-only int8 linears for CPUs (`--quantization int8`, W8A16): float checkpoint weights
quantized at load to symmetric int8 per output channel, activations in the model dtype, run by
torch's own CPU kernel `torch._weight_int8pack_mm`; and the builder the loader streams shards into."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import ConfigError
from engine.weights.formats.packed_linear import DenseWeight, QuantizedLinear
from engine.weights.formats.shard_checks import FloatQuantizingBuilder
from kernels import cpu_gemv

_QMAX = 127  # symmetric: -127..127, so negating a weight never overflows
# The activation dtypes `_weight_int8pack_mm` takes on CPU (its scales must be the same dtype).
INT8_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# NOTE: torch 2.13's CPU kernel crashes (SIGSEGV) for bf16 activations unless K is a multiple of
# 16 (found by probing: K = 8, 24, 100, 120 crash, at 1 or more rows). Such a layer's codes are
# padded with zero columns and its input with zeros: the products are unchanged.
_BF16_K_MULTIPLE = 16


def quantize_int8(weight: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """[N, K] float weight -> (int8 codes [N, K], scales [N] in `dtype`), one scale per output row.

    NOTE: each row is rounded against its scale as stored in `dtype` (a bf16 scale is not amax/127
    exactly), so the codes times the stored scale are the nearest int8 grid to the weight that the
    kernel will actually multiply. An all-zero row gets scale 1 and zero codes."""
    w = weight.detach().float()  # [N, K] float32
    amax = w.abs().amax(dim=1)  # [N]
    scales = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax)).to(dtype)  # [N] dtype
    codes = torch.round(w / scales.float()[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)  # [N, K]
    return codes.contiguous(), scales


def dequantize_int8(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The float weight [N, K] an int8 linear multiplies by: codes times their row's scale."""
    return (codes.float() * scales.float()[:, None]).to(dtype)


class Int8Linear(QuantizedLinear):
    """y = x (codes * scales)^T (+ b), with the codes never widened in memory.

    `_weight_int8pack_mm` wants a 2D activation contiguous in its last dimension, a contiguous
    [N, K] int8 weight and scales in the activation's dtype; forward flattens the leading dims."""

    def __init__(self, codes: Tensor, scales: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        assert codes.dtype == torch.int8 and codes.dim() == 2, f"int8 [N, K] codes expected, got {codes.dtype}"
        assert scales.shape == codes.shape[:1], "one scale per output row"
        assert scales.dtype in INT8_ACTIVATION_DTYPES, f"scales in an activation dtype, got {scales.dtype}"
        self.out_features, self.in_features = codes.shape
        self.pad = -self.in_features % _BF16_K_MULTIPLE if scales.dtype == torch.bfloat16 else 0
        if self.pad:
            codes = F.pad(codes, (0, self.pad))  # [N, K + pad], zero columns
        self.register_buffer("codes", codes.contiguous())  # [N, K (+ pad)] int8
        self.register_buffer("scales", scales)  # [N], the activation dtype
        self.register_buffer("bias", bias)  # [N] activation dtype, or None
        # Optional: the dequantized weight (engine/weights/formats/packed_linear.py's DenseWeight), for inputs of at
        # least `dense_from_rows` rows (`keep_dense_copy`); None: every input runs the int8 kernel.
        self.dense: DenseWeight | None = None
        self.dense_from_rows = 0
        self.cpu_gemv = False  # the compiled C++ op instead of torch's kernel (use_cpu_gemv)

    @staticmethod
    def from_float(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Int8Linear:
        codes, scales = quantize_int8(weight, dtype)
        return Int8Linear(codes, scales, None if bias is None else bias.detach().to(dtype))

    @property
    def weight_codes(self) -> Tensor:
        """The codes [N, K] without any padding columns."""
        return self.codes[:, : self.in_features]

    @property
    def weight_nbytes(self) -> int:
        """The int8 codes and scales (not a dense copy: `dense_nbytes`)."""
        return self.codes.nbytes + self.scales.nbytes

    def keep_dense_copy(self, from_rows: int) -> None:
        """Inputs of `from_rows` rows or more multiply a dense copy of the dequantized weight (the
        same values, codes times scales, in the activation dtype) with the float GEMM instead.

        NOTE: `_weight_int8pack_mm` is a matrix-vector kernel: its time grows linearly with the rows
        (docs/PERF.md: the bf16 GEMM was faster from ~14 rows on SmolLM2's shapes). The copy costs
        the weight's bytes once more, so only `--quantization auto` asks for it."""
        assert from_rows > 0, "a row threshold of at least 1"
        self.dense = DenseWeight(dequantize_int8(self.weight_codes, self.scales), self.scales.dtype)
        self.dense_from_rows = from_rows

    def quantized_mm(self, x2: Tensor) -> Tensor:
        if self.pad:
            x2 = F.pad(x2, (0, self.pad))  # [T, K + pad], a new contiguous tensor
        elif x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if self.cpu_gemv:
            return cpu_gemv.int8_gemv(x2, self.codes, self.scales)  # [T, N], x's dtype
        return torch._weight_int8pack_mm(x2, self.codes, self.scales)  # [T, N], x's dtype

    def format_repr(self) -> str:
        return "int8 per-channel"


def use_cpu_gemv(model: nn.Module) -> bool:
    """Run `model`'s int8 lm_head (beside int4 or int8 layers) through the compiled op of
    kernels/cpu_gemv.py (loaded by engine/host/cpu_kernels.py) instead of
    `torch._weight_int8pack_mm`; whether it has one.

    NOTE: the head only: it is where the op was measured faster (1.6-1.9x on SmolLM2's 27 MiB head
    at one row, docs/PERF.md "The 1-stream step"); the layers' int8 shapes were not measured."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, Int8Linear):
        return False
    head.cpu_gemv = True
    return True


def check_int8_device(device: torch.device) -> None:
    """int8 runs on CPU only: its CUDA path has never been run or tested here."""
    if device.type != "cpu":
        raise ConfigError(
            f"--quantization int8: CPU only (the device is {device.type}); on a GPU use "
            "--quantization nvfp4 or a float dtype"
        )


class Int8LinearBuilder(FloatQuantizingBuilder):
    """One int8 linear from float checkpoint tensors; `build` once all have arrived. Rows are scaled
    one by one, so fusing is exact."""

    scheme = "int8"

    def quantize(self, shard: int, weight: Tensor) -> tuple[Tensor, Tensor]:
        return quantize_int8(weight, self.dtype)  # (codes, scales)

    def build(self) -> Int8Linear:
        shards = self.complete_shards()
        codes = torch.cat([c for c, _ in shards])  # [N, K] int8
        scales = torch.cat([s for _, s in shards])  # [N]
        return Int8Linear(codes, scales, self.bias)
