"""The compiled CPU ops (`torch.ops.fp4serve_cpu.*`: paged attention, kernels/cpu_attention.cpp;
norms, activation, RoPE, kernels/cpu_elementwise.cpp; the int8 linear for a few rows,
kernels/cpu_gemv.cpp; RoPE, cache write and attention as one op, kernels/cpu_fused_attention.cpp;
a whole int4 decoder layer, kernels/cpu_decode_layer.cpp; the int4 linear for a few rows,
kernels/cpu_int4.cpp): how the library is compiled for the machine at hand (g++ -O3
-march=native against torch's headers), loaded into torch, and given fake (shape-only)
implementations for torch.compile. Their wrappers and pure-torch references live in
kernels/cpu_attention.py, kernels/cpu_elementwise.py and kernels/cpu_gemv.py."""

from __future__ import annotations

import hashlib
import platform
import subprocess
from pathlib import Path

import torch
from torch import Tensor

_HERE = Path(__file__).parent
# How the sources are compiled: one compiler per unit, the units at once. Parsing torch's headers is
# most of a small source's compile, so the small ones share one unit (a file that includes them),
# and the work splits about evenly over two cores.
UNITS = (
    (_HERE / "cpu_attention.cpp",),
    (_HERE / "cpu_gemv.cpp",),
    (
        _HERE / "cpu_elementwise.cpp",
        _HERE / "cpu_fused_attention.cpp",
        _HERE / "cpu_decode_layer.cpp",
        _HERE / "cpu_int4.cpp",
    ),
)
SOURCES = tuple(source for unit in UNITS for source in unit)
HEADERS = (_HERE / "cpu_vec.h",)
LIBRARY_NAME = "libfp4serve_cpu.so"
NAMESPACE = "fp4serve_cpu"


def build_key() -> str:
    """What the compiled library depends on: the sources, torch's version and ABI, the compiler's
    target (-march=native: the CPU's model and flags)."""
    parts = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    parts += [
        torch.__version__.encode(),
        str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(),
        platform.machine().encode(),
        _cpu_signature().encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpu_signature() -> str:
    """The CPU's model name and flags (Linux); the compiled code uses every extension it has."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))}))


def compile_library(folder: Path, compiler: str = "g++") -> Path:
    """Compile the sources into `folder`/LIBRARY_NAME for this machine; RuntimeError with the
    compiler's output when it fails or cannot run. Each of UNITS compiles to its own object, all at
    once (the first start of a server, and each test run on a fresh machine, waits for the slowest
    unit instead of the sum), then one link."""
    from torch.utils import cpp_extension

    out = folder / LIBRARY_NAME
    lib_dirs = cpp_extension.library_paths()
    flags = [
        compiler,
        "-O3",
        "-march=native",
        "-fopenmp",
        "-fPIC",
        "-std=c++20",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]
    objects, compiles = [], []
    for i, unit in enumerate(UNITS):
        if len(unit) == 1:
            source = unit[0]
        else:
            source = folder / f"unit{i}.cpp"
            source.write_text("".join(f'#include "{part}"\n' for part in unit))
        objects.append(folder / f"{source.stem}.o")
        compiles.append(
            [*flags, *[f"-I{p}" for p in cpp_extension.include_paths()], "-c", str(source), "-o", str(objects[-1])]
        )
    _run_all(compiles, compiler)
    _run_all(
        [
            [
                *flags,
                "-shared",
                *map(str, objects),
                "-o",
                str(out),
                *[f"-L{p}" for p in lib_dirs],
                "-lc10",
                "-ltorch_cpu",
                *[f"-Wl,-rpath,{p}" for p in lib_dirs],
            ]
        ],
        compiler,
    )
    for leftover in (*objects, *folder.glob("unit*.cpp")):
        leftover.unlink(missing_ok=True)
    return out


def _run_all(commands: list[list[str]], compiler: str) -> None:
    """Run the commands at once; RuntimeError with the first failure's output."""
    try:
        running = [
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in commands
        ]
    except OSError as e:
        raise RuntimeError(f"{compiler} could not run ({e})") from None
    results = [(p, *p.communicate()) for p in running]
    for process, _, stderr in results:
        if process.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({process.returncode}): {stderr.strip()[-2000:]}")


def ops_loaded() -> bool:
    return hasattr(torch.ops, NAMESPACE) and hasattr(getattr(torch.ops, NAMESPACE), "paged_attention")


def load_library(path: Path) -> None:
    """Load the compiled ops into torch (once per process) and register their fake implementations."""
    if ops_loaded():
        return
    torch.ops.load_library(str(path))
    for name, fake in _FAKES.items():
        torch.library.register_fake(f"{NAMESPACE}::{name}")(fake)


def _like(x: Tensor, *rest: object) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _add_rms_norm_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _like(x), _like(x)


def _silu_and_mul_fake(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _reshape_and_cache_fake(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    return None


def _rope_cache_attention_fake(qkv: Tensor, cos: Tensor, signed_sin: Tensor, kv_cache: Tensor, *rest: object) -> Tensor:
    num_heads = rest[-2]
    assert isinstance(num_heads, int)
    return qkv.new_empty((qkv.shape[0], num_heads * kv_cache.shape[-1]))


def _decode_layer_int4_fake(x: Tensor, *rest: object) -> Tensor:
    return _like(x)


def _int8_gemv_fake(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], codes.shape[0]))


def _int4_gemv_fake(x: Tensor, codes: Tensor, scales_zeros: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], codes.shape[0]))


def _argmax_rows_fake(x: Tensor) -> Tensor:
    return x.new_empty((x.shape[0],), dtype=torch.int64)


_FAKES = {
    "paged_attention": _like,
    "reshape_and_cache": _reshape_and_cache_fake,
    "rms_norm": _like,
    "add_rms_norm": _add_rms_norm_fake,
    "silu_and_mul": _silu_and_mul_fake,
    "rotary": _like,
    "int8_gemv": _int8_gemv_fake,
    "rope_cache_attention": _rope_cache_attention_fake,
    "decode_layer_int4": _decode_layer_int4_fake,
    "int4_gemv": _int4_gemv_fake,
    "argmax_rows": _argmax_rows_fake,
}
