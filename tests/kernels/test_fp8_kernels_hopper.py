"""The block-FP8 kernels compiled for Hopper (sm_90) on this GPU-less machine, with the ptxas
Triton ships: they compile to a cubin, the activation quantization is the hardware's saturating
round-to-nearest e4m3 cast, and prefill tiles multiply on FP8 tensor cores (wgmma e4m3 x e4m3).
Nothing here runs them: that needs a GPU (docs/gpu.md)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import triton


def compile_for_hopper(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert isinstance(fn, triton.runtime.jit.JITFunction), "the kernel module is loaded interpreted"
    for name in constexprs:
        signature[name] = "constexpr"
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": 3},
    )
    assert compiled.asm["cubin"], "no cubin"
    return compiled.asm["ptx"]


def instructions(ptx: str) -> set[str]:
    return set(re.findall(r"^\s*((?:wgmma|mma|cvt)[\w.]*)", ptx, re.M))


def test_w8a8_gemm_compiles_to_fp8_tensor_core_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    from kernels import fp8_triton

    signature = {
        "x_ptr": "*bf16",
        "w_ptr": "*fp8e4nv",
        "s_ptr": "*fp32",
        "b_ptr": "*bf16",
        "out_ptr": "*bf16",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        **{f"stride_{n}": "i32" for n in ("xm", "xk", "wn", "wk", "sn", "sk", "om", "on")},
    }
    config = fp8_triton.choose_fp8_config(512)
    ptx = compile_for_hopper(
        fp8_triton._w8a8_block_kernel,
        signature,
        {
            "SCALE_BLOCK_N": 128,
            "GROUP_K": 128,
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
            "HAS_BIAS": True,
            "FP8_MAX_C": 448.0,
            "EPS": 1e-10,
        },
        config.num_warps,
    )
    ops = instructions(ptx)
    assert any(op.startswith("wgmma.mma_async") and op.endswith("f32.e4m3.e4m3") for op in ops), ops
    assert "cvt.rn.satfinite.e4m3x2.f32" in ops


def test_fp8_moe_kernel_compiles_for_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    from kernels import fused_moe_fp8_triton

    signature = {
        "x_ptr": "*bf16",
        "w_ptr": "*fp8e4nv",
        "s_ptr": "*fp32",
        "out_ptr": "*bf16",
        "topk_w_ptr": "*fp32",
        "sorted_ptr": "*i32",
        "block_expert_ptr": "*i32",
        "num_padded_ptr": "*i32",
        "N": "i32",
        "K": "i32",
        "num_valid": "i32",
        "top_k": "i32",
        **{f"stride_{n}": "i32" for n in ("xm", "xk", "we", "wn", "wk", "se", "sn", "sk", "om", "on")},
    }
    ptx = compile_for_hopper(
        fused_moe_fp8_triton._moe_fp8_kernel,
        signature,
        {
            "SCALE_BLOCK_N": 1,
            "GROUP_K": 128,
            "BLOCK_M": 64,
            "BLOCK_N": 128,
            "MUL_WEIGHT": True,
            "FP8_MAX_C": 448.0,
            "EPS": 1e-10,
        },
        8,
    )
    ops = instructions(ptx)
    assert any(op.startswith("wgmma.mma_async") and op.endswith("f32.e4m3.e4m3") for op in ops), ops
