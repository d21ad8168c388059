"""oneDNN's pre-packed bf16 weights for CPU linears: a weight reordered once, at load, into the
blocked layout oneDNN's GEMM reads (`torch.ops.mkldnn._reorder_linear_weight`), so no call pays
the reorder; `PackedLinear`, the float linear that holds one; and `DenseWeight`, the dense copy
the int8/int4 linears keep for large inputs (packed bf16, or float32 where bf16 is not native),
and `QuantizedLinear`, what those two linears share around their kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models import layers
from engine.models.layers import Linear


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 on a CPU whose oneDNN runs bf16 natively (AVX512-BF16 or AMX): there the packed GEMM
    beat the plain one at every batch size measured (docs/PERF.md). float32 keeps MKL's GEMM."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack_weight(weight: Tensor) -> Tensor:
    """[N, K] bf16 -> the same weight as an opaque oneDNN tensor (layout `torch._mkldnn`).

    NOTE: a packed tensor has no storage: no data_ptr, no state_dict entry, no views. Its owner
    reports its bytes (`packed_nbytes`); `.to_dense()` gives the weight back."""
    assert weight.dim() == 2 and weight.dtype == torch.bfloat16, f"a 2D bf16 weight, got {weight.dtype}"
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_nbytes(packed: Tensor) -> int:
    return packed.numel() * packed.element_size()


def packed_linear(x2: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x2 [T, K] bf16 @ packed^T (+ bias) -> [T, N] bf16, through oneDNN's GEMM."""
    return torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")


class DenseWeight:
    """A quantized linear's weight, dequantized, for inputs of many rows, where a GEMM beats the
    int8/int4 matrix-vector kernels: oneDNN-packed bf16 where `can_pack` (the activations' own
    dtype), else float32 through MKL's GEMM, the activations cast to float32 and the result back
    (bf16 GEMMs without native bf16 were 3x slower than float32 at 32 rows, docs/PERF.md)."""

    def __init__(self, weight: Tensor, activation_dtype: torch.dtype) -> None:
        """`weight` [N, K] float (the dequantized values)."""
        self.activation_dtype = activation_dtype
        self.packed = can_pack(activation_dtype, weight.device)
        w = weight.detach()
        # [N, K]: oneDNN-packed bf16, or a contiguous float32/activation-dtype tensor
        self.weight = pack_weight(w.to(torch.bfloat16)) if self.packed else w.to(self.compute_dtype).contiguous()

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.packed or self.activation_dtype == torch.float32:
            return self.activation_dtype
        return torch.float32

    @property
    def nbytes(self) -> int:
        return packed_nbytes(self.weight)

    def __call__(self, x2: Tensor, bias: Tensor | None) -> Tensor:
        """x2 [T, K] in the activation dtype -> [T, N] in the same dtype."""
        if self.packed:
            return packed_linear(x2 if x2.is_contiguous() else x2.contiguous(), self.weight, bias)
        dtype = self.compute_dtype
        y = F.linear(x2.to(dtype), self.weight, None if bias is None else bias.to(dtype))
        return y.to(self.activation_dtype)


class QuantizedLinear(nn.Module):
    """What the weight-only int8 and int4 linears share: y = x W^T (+ b) on `[..., K]` inputs
    flattened to rows, through the subclass's kernel (`quantized_mm`), or through a `DenseWeight`
    copy for inputs of at least `dense_from_rows` rows (the kernels are matrix-vector: their time
    grows with the rows). Subclasses set in_features, out_features, bias, dense, dense_from_rows."""

    in_features: int
    out_features: int
    bias: Tensor | None
    dense: DenseWeight | None
    dense_from_rows: int

    def quantized_mm(self, x2: Tensor) -> Tensor:
        """x2 [T, K] in the activation dtype -> [T, N], without the bias."""
        raise NotImplementedError

    def format_repr(self) -> str:
        raise NotImplementedError

    @property
    def dense_nbytes(self) -> int:
        return 0 if self.dense is None else self.dense.nbytes

    @property
    def packed_nbytes(self) -> int:
        """Bytes outside the state_dict (`packed_bytes` sums them): the dense copy."""
        return self.dense_nbytes

    def forward(self, x: Tensor) -> Tensor:
        # NOTE: the decoder's [T, K] rows skip the reshape and view: two ops a call, 240 per 1-row
        # step of SmolLM2, ~0.4 ms of its CPU time (docs/PERF.md, "The 1-stream step").
        rows = x.dim() == 2
        x2 = x if rows else x.reshape(-1, self.in_features)  # [T, K]
        if self.dense is not None and x2.shape[0] >= self.dense_from_rows and not layers.kernels_only():
            y = self.dense(x2, self.bias)
        else:
            y = self.quantized_mm(x2)  # [T, N], x's dtype
            if self.bias is not None:
                y = y.add_(self.bias)
        return y if rows else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        dense = f", dense copy from {self.dense_from_rows} rows" if self.dense is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.format_repr()}{dense}"


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W held only in oneDNN's packed layout (the float copy is dropped)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack_weight(weight)  # opaque [N, K] bf16; deliberately no buffer (no storage)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())  # [N] bf16

    @staticmethod
    def from_linear(linear: Linear) -> PackedLinear:
        return PackedLinear(linear.weight, linear.bias)

    @property
    def packed_nbytes(self) -> int:
        return packed_nbytes(self.packed)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:  # the decoder's [T, K] rows: no reshape and view (QuantizedLinear.forward)
            return packed_linear(x if x.is_contiguous() else x.contiguous(), self.packed, self.bias)
        x2 = x.reshape(-1, self.in_features)
        return packed_linear(x2 if x2.is_contiguous() else x2.contiguous(), self.packed, self.bias).view(
            *x.shape[:-1], self.out_features
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 oneDNN-packed"


# Linears left in their float form: MoE routers (`route` reads their weight; tiny anyway).
_UNPACKED_SUFFIXES = (".gate", ".shared_expert_gate")


def pack_float_linears(model: nn.Module) -> int:
    """Swap every bf16 `Linear` of `model` but the MoE routers for a `PackedLinear`; how many. A
    tied lm_head gets a packed copy: the embedding keeps its own weight."""
    total = 0
    for path, module in list(model.named_modules()):
        if (
            isinstance(module, Linear)
            and module.weight.dtype == torch.bfloat16
            and not path.endswith(_UNPACKED_SUFFIXES)
        ):
            packed = PackedLinear.from_linear(module)
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, packed)
            total += 1
    return total


def packed_bytes(model: nn.Module) -> int:
    """Bytes held in packed tensors, which have no storage and so no state_dict entry: the packed
    linears' weights and the int4/int8 linears' dense copies."""
    return sum(getattr(m, "packed_nbytes", 0) for m in model.modules())
