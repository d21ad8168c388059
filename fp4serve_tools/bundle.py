"""`fp4serve bundle`: everything an air-gapped GPU server needs to run fp4serve's FlashInfer kernels,
in one folder: FlashInfer's wheel trimmed to what those kernels read, with the kernels for the served
model shapes prebuilt into its AOT layout (`flashinfer/data/aot/<name>/<name>.so`), the few wheels
`import flashinfer` needs, a manifest and an install script. See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.attention.flashinfer import decode_uses_tensor_cores, prefill_backend_for
from engine.attention.select import flashinfer_shape_error
from engine.errors import ConfigError
from engine.weights.config.model_config import ModelConfig

FLASHINFER = "flashinfer-python==0.7.2.post1"  # the API engine/attention/flashinfer.py is written against
# What `import flashinfer` needs beyond what the GPU server has (torch, numpy, jinja2, filelock
# come with torch and transformers); install.sh checks those are there.
TVM_FFI = "apache-tvm-ffi>=0.1.11,<0.2"  # flashinfer's pin
RUNTIME_REQUIREMENTS = (TVM_FFI, "nvidia-ml-py", "ninja", "requests", "tqdm", "packaging")
PRESUMED_INSTALLED = ("torch", "numpy", "jinja2", "filelock")
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
MAX_BUNDLE_BYTES = 60 << 20
# Qwen3-8B's attention shape: what is built when no --model is given.
DEFAULT_SHAPE_NAME = "Qwen3-8B"

# Under flashinfer/data/ the wheel ships the CUDA sources of every kernel it has (~250 MB). Kept:
# the headers a JIT build includes (FlashInfer's, CUTLASS, vendored CCCL, spdlog), the top-level
# csrc files the module generators copy and render (our kernels' .cu/.jinja and the shared
# bindings), and the AOT kernels. Dropped: csrc's per-kernel-family folders, CUTLASS/CCCL
# examples, tests and Python.
_DATA = "flashinfer/data/"
_KEEP_DATA = (
    "include/",
    "cutlass/include/",
    "cutlass/tools/util/include/",
    "cccl/cub/cub/",
    "cccl/libcudacxx/include/",
    "cccl/thrust/thrust/",
    "spdlog/include/",
    "aot/",
)


def keep_in_wheel(path: str) -> bool:
    """Whether a file of the flashinfer wheel stays in the trimmed one (all Python stays)."""
    if not path.startswith(_DATA):
        return True
    rest = path[len(_DATA) :]
    if "/" not in rest:
        return True
    if rest.startswith("csrc/"):
        return "/" not in rest[len("csrc/") :]
    return rest.startswith(_KEEP_DATA)


@dataclass(frozen=True)
class TrimReport:
    kept_files: int
    dropped_files: int
    dropped_bytes: int  # uncompressed
    wheel_bytes: int


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def trim_wheel(src: Path, dst: Path, extra: Mapping[str, bytes] | None = None) -> TrimReport:
    """Write `src` minus what `keep_in_wheel` drops, plus `extra` files (archive name -> bytes),
    with a RECORD that lists exactly the files written, so pip installs it as any wheel."""
    extra = dict(extra or {})
    kept = dropped = dropped_bytes = 0
    records: list[str] = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        names = zin.namelist()
        record = next((n for n in names if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)), None)
        assert record is not None, f"{src.name}: no .dist-info/RECORD, not a wheel"
        for info in zin.infolist():
            name = info.filename
            if name == record or info.is_dir() or name in extra:
                continue
            if not keep_in_wheel(name):
                dropped, dropped_bytes = dropped + 1, dropped_bytes + info.file_size
                continue
            data = zin.read(info)
            zout.writestr(info, data, zipfile.ZIP_DEFLATED)
            records.append(f"{name},{_record_hash(data)},{len(data)}")
            kept += 1
        for name, data in sorted(extra.items()):
            zout.writestr(name, data)
            records.append(f"{name},{_record_hash(data)},{len(data)}")
        zout.writestr(record, "\n".join([*records, f"{record},,"]) + "\n")
    return TrimReport(kept + len(extra), dropped, dropped_bytes, dst.stat().st_size)


# ---- which kernels --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16" | "float16": what the server runs on the GPU


DEFAULT_SHAPE = ModelShape(DEFAULT_SHAPE_NAME, 32, 8, 128, "bfloat16")


def model_shape(path: Path) -> ModelShape:
    """A checkpoint's attention shape, in the dtype the server picks for it on a GPU."""
    import torch

    cfg = ModelConfig.from_checkpoint(path)
    dtype = "float16" if cfg.torch_dtype == "float16" else "bfloat16"  # resolve_dtype on CUDA
    why = flashinfer_shape_error(getattr(torch, dtype), cfg.head_dim)
    if why:
        raise ConfigError(f"--model {path}: FlashInfer does not cover {why}; this model serves on the torch backend")
    return ModelShape(path.name, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype)


@dataclass(frozen=True)
class KernelSpec:
    """One FlashInfer JIT module; `module` is FlashInfer's name for it (its URI)."""

    kind: str  # "decode" (CUDA-core decode) | "prefill" (paged prefill, also tensor-core decode)
    backend: str  # "fa2" | "fa3"
    dtype: str
    head_dim: int

    @property
    def module(self) -> str:
        d = {"bfloat16": "bf16", "float16": "f16"}[self.dtype]
        hd = self.head_dim
        common = (
            f"dtype_q_{d}_dtype_kv_{d}_dtype_o_{d}_dtype_idx_i32_head_dim_qk_{hd}_head_dim_vo_{hd}_posenc_0_"
            "use_swa_False_use_logits_cap_False"
        )
        if self.kind == "decode":
            return f"batch_decode_with_kv_cache_{common}"
        # fa2: the equal-K/V-stride module the wrapper loads for our [P, 2, page, H, D] cache.
        suffix = "_sm90" if self.backend == "fa3" else "_kv_stride_equal"
        return f"batch_prefill_with_kv_cache_{common}_f16qk_False{suffix}"


def parse_arch(arch: str) -> tuple[tuple[int, int], str]:
    """ "sm_90a" -> ((9, 0), "9.0a"): the compute capability and FLASHINFER_CUDA_ARCH_LIST."""
    m = re.fullmatch(r"sm_(\d+)(\d)([af]?)", arch)
    if m is None:
        raise ConfigError(f"--arch: '{arch}' is not a CUDA arch like sm_90a or sm_100a")
    major, minor, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
    return (major, minor), f"{major}.{minor}{suffix}"


def plan_kernels(shapes: Sequence[ModelShape], arch: str) -> list[KernelSpec]:
    """The modules FlashInferAttentionBackend loads for these shapes on `arch`, deduplicated."""
    capability, _ = parse_arch(arch)
    specs: dict[KernelSpec, None] = {}
    for s in shapes:
        if decode_uses_tensor_cores(s.num_heads, s.num_kv_heads):
            specs[KernelSpec("prefill", "fa2", s.dtype, s.head_dim)] = None
        else:
            specs[KernelSpec("decode", "fa2", s.dtype, s.head_dim)] = None
        specs[KernelSpec("prefill", prefill_backend_for(capability, s.head_dim), s.dtype, s.head_dim)] = None
    return list(specs)


def aot_name(module: str) -> str:
    return f"{_DATA}aot/{module}/{module}.so"


# ---- downloads ------------------------------------------------------------------------------------
def pip_download_command(
    requirements: Sequence[str], dest: Path, *, no_deps: bool, find_links: Path | None = None
) -> list[str]:
    """pip download of cp312 manylinux x86_64 wheels (the GPU server's), binaries only."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "--python-version",
        TARGET_PYTHON,
        "--implementation",
        "cp",
        "--dest",
        str(dest),
    ]
    for platform in TARGET_PLATFORMS:
        cmd += ["--platform", platform]
    if no_deps:
        cmd.append("--no-deps")
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    return cmd + list(requirements)


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return name.lower().replace("_", "-"), version


def _run(cmd: Sequence[str], **kwargs: object) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


# ---- prebuilding the kernels ------------------------------------------------------------------------
# Runs in a child python whose path holds the trimmed flashinfer: FlashInfer's own generators
# render the sources and write the ninja file, so each .so is what its JIT would build.
_BUILD_SCRIPT = r"""
import json, sys
import torch
from flashinfer.jit.attention import modules as m
built = {}
for k in json.loads(sys.argv[1]):
    dt = getattr(torch, k["dtype"])
    args = (dt, dt, dt, torch.int32, k["head_dim"], k["head_dim"], 0, False, False)
    if k["kind"] == "decode":
        spec = m.gen_batch_decode_module(*args)
    elif k["backend"] == "fa2":
        spec = m._gen_batch_prefill_primary_module("fa2", *args, False)
    else:
        spec = m.gen_batch_prefill_module("fa3", *args, False)
    if spec.name != k["module"]:
        sys.exit(f"FlashInfer names this module {spec.name}; fp4serve expected {k['module']}")
    spec.build(verbose=True)
    built[spec.name] = str(spec.jit_library_path)
open(sys.argv[2], "w").write(json.dumps(built))
"""


def cuda_home() -> Path | None:
    """The CUDA toolkit root. NOTE: FlashInfer takes dirname(dirname(which nvcc)), wrong for a
    wrapper such as /usr/local/bin/nvcc, so the build passes CUDA_HOME explicitly."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return Path(os.environ[var])
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return Path("/usr/local/cuda")
    nvcc = shutil.which("nvcc")
    return Path(nvcc).resolve().parent.parent if nvcc else None


def _has_header(home: Path, name: str) -> bool:
    return any((d / name).exists() for d in [home / "include", *home.glob("targets/*/include")])


def _curand_headers(work: Path) -> Path:
    """cuRAND's headers from its CUDA 13 wheel: CUTLASS's tensor_fill.h (fa3) includes
    curand_kernel.h, which a minimal toolkit lacks."""
    dest = work / "curand"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(dest),
            "nvidia-curand>=10.4",
        ]
    )
    include = work / "curand-include"
    with zipfile.ZipFile(next(dest.glob("*.whl"))) as z:
        z.extractall(include, [n for n in z.namelist() if "/include/" in n])
    return next(include.glob("nvidia/*/include"))


def build_kernels(
    kernels: Sequence[KernelSpec], arch: str, wheel: Path, tvm_ffi_version: str, work: Path
) -> dict[str, bytes]:
    """Compile `kernels` for `arch` with nvcc (no GPU needed): archive name -> .so bytes."""
    home = cuda_home()
    if home is None or not (home / "bin" / "nvcc").exists():
        raise ConfigError("no nvcc found (set CUDA_HOME): install the CUDA toolkit here, or bundle with --no-build")
    _, arch_list = parse_arch(arch)
    site = work / "site"
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--target", str(site)]
    _run([*pip, "--no-deps", str(wheel)])
    # The bundle's tvm-ffi version: the .so files are built against its ABI.
    _run([*pip, f"apache-tvm-ffi=={tvm_ffi_version}", *(r for r in RUNTIME_REQUIREMENTS if r != TVM_FFI)])
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "CUDA_HOME": str(home),
        "FLASHINFER_CUDA_ARCH_LIST": arch_list,
        "FLASHINFER_WORKSPACE_BASE": str(work),
        "MAX_JOBS": str(os.cpu_count() or 1),
    }
    if not any((home / d / "libcuda.so").exists() for d in ("lib64/stubs", "lib64")):
        # -lcuda needs something to link against; the kernels call no driver API, so an empty
        # stub with the driver's soname does.
        stubs = work / "stubs"
        stubs.mkdir(exist_ok=True)
        _run(["cc", "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(stubs / "libcuda.so"), "-x", "c", "/dev/null"])
        env["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{stubs}"
    if any(k.backend == "fa3" for k in kernels) and not _has_header(home, "curand_kernel.h"):
        env["FLASHINFER_EXTRA_CUDAFLAGS"] = f"-I{_curand_headers(work)}"
    plan = json.dumps([{**asdict(k), "module": k.module} for k in kernels])
    result = work / "built.json"
    _run([sys.executable, "-c", _BUILD_SCRIPT, plan, str(result)], env=env, cwd=work)
    built: dict[str, str] = json.loads(result.read_text())
    return {aot_name(name): Path(so).read_bytes() for name, so in built.items()}


# ---- install script and manifest --------------------------------------------------------------------
_INSTALL = """#!/usr/bin/env bash
# Installs this fp4serve GPU bundle (manifest.json, docs/gpu.md) into the python that runs
# fp4serve: PYTHON=/path/to/python bash install.sh (default: python3).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; v = "%d.%d" % sys.version_info[:2]; assert v == "@PYTHON@", "bundle for Python @PYTHON@, this is " + v'
"$PY" -c 'import @PRESUMED@' || { echo "install.sh: first install @PRESUMED@" >&2; exit 1; }
# The prebuilt kernels need exactly this tvm-ffi (their ABI); the other dependencies are
# installed only where missing, an installed version is kept.
"$PY" -m pip install --no-index --find-links "$HERE/wheels" --no-deps @PINNED@
"$PY" -m pip install --no-index --find-links "$HERE/wheels" --no-deps @OTHERS@
# --no-deps: FlashInfer's metadata also lists packages only its Blackwell and MoE kernels use.
"$PY" -m pip install --no-index --no-deps --force-reinstall "$HERE/wheels/@WHEEL@"
FLASHINFER_DISABLE_JIT=1 "$PY" - @MODULES@ <<'CHECK'
import pathlib, sys
import flashinfer, tvm_ffi
aot = pathlib.Path(flashinfer.__file__).parent / "data" / "aot"
for name in sys.argv[1:]:
    tvm_ffi.load_module(str(aot / name / f"{name}.so"))
print(f"flashinfer {flashinfer.__version__} imports; {len(sys.argv) - 1} prebuilt kernels load")
CHECK
"""


def install_script(flashinfer_wheel: str, pinned: Sequence[str], others: Sequence[str], modules: Sequence[str]) -> str:
    """bash: install the bundled wheels into $PYTHON, then load every prebuilt kernel with JIT off."""
    fields = {
        "@PYTHON@": TARGET_PYTHON,
        "@PRESUMED@": ", ".join(PRESUMED_INSTALLED),
        "@PINNED@": " ".join(pinned),
        "@OTHERS@": " ".join(others),
        "@WHEEL@": flashinfer_wheel,
        "@MODULES@": " ".join(modules),
    }
    return re.sub("|".join(fields), lambda m: fields[m.group(0)], _INSTALL)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bundle_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


# ---- the command ------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write the bundle into")
    parser.add_argument("--arch", default="sm_90a", help="CUDA arch of the GPU server (sm_90a: H100, H200)")
    parser.add_argument(
        "--model",
        type=Path,
        nargs="+",
        default=[],
        metavar="PATH",
        help=f"checkpoint folders whose attention shapes to prebuild (default: {DEFAULT_SHAPE_NAME}'s)",
    )
    parser.add_argument(
        "--no-build",
        action="store_true",
        help="skip compiling: the GPU server then JIT-builds on first use, with its own nvcc",
    )
    parser.add_argument(
        "--find-links",
        type=Path,
        metavar="DIR",
        help="take the wheels from this folder instead of PyPI (an offline rebuild)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        shapes = [model_shape(p) for p in args.model] or [DEFAULT_SHAPE]
        kernels = plan_kernels(shapes, args.arch)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out: Path = args.out
    wheels = out / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)  # the manifest lists exactly this run's wheels
    wheels.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="fp4serve-bundle-") as tmp:
        work = Path(tmp)
        _run(pip_download_command([FLASHINFER], work / "dl", no_deps=True, find_links=args.find_links))
        _run(pip_download_command(RUNTIME_REQUIREMENTS, wheels, no_deps=False, find_links=args.find_links))
        src = next((work / "dl").glob("flashinfer_python-*.whl"))
        versions = dict(wheel_name_version(w) for w in wheels.glob("*.whl"))
        aot: dict[str, bytes] = {}
        if not args.no_build:
            trim_wheel(src, work / src.name)
            try:
                aot = build_kernels(kernels, args.arch, work / src.name, versions["apache-tvm-ffi"], work)
            except ConfigError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        report = trim_wheel(src, wheels / src.name, aot)
        original_bytes = src.stat().st_size
    prebuilt = [k.module for k in kernels if aot_name(k.module) in aot]
    others = sorted(n for n in versions if n not in ("apache-tvm-ffi", "flashinfer-python"))
    script = install_script(src.name, [f"apache-tvm-ffi=={versions['apache-tvm-ffi']}"], others, prebuilt)
    (out / "install.sh").write_text(script)
    (out / "install.sh").chmod(0o755)
    manifest = {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "arch": args.arch,
        "python": TARGET_PYTHON,
        "requires_installed": list(PRESUMED_INSTALLED),
        "flashinfer": {"wheel": src.name, "original_bytes": original_bytes, **asdict(report)},
        "models": [asdict(s) for s in shapes],
        "kernels": [{**asdict(k), "module": k.module, "prebuilt": k.module in prebuilt} for k in kernels],
        "wheels": [
            {
                "file": w.name,
                "name": wheel_name_version(w)[0],
                "version": wheel_name_version(w)[1],
                "bytes": w.stat().st_size,
                "sha256": _sha256(w),
            }
            for w in sorted(wheels.glob("*.whl"))
        ],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = bundle_bytes(out)
    print(
        f"bundle {out}: {total / 2**20:.1f} MiB; flashinfer wheel {original_bytes / 2**20:.1f} -> "
        f"{report.wheel_bytes / 2**20:.1f} MiB; {len(prebuilt)}/{len(kernels)} kernels prebuilt for {args.arch}"
    )
    if total > MAX_BUNDLE_BYTES:
        print(f"error: the bundle is over its {MAX_BUNDLE_BYTES >> 20} MiB budget", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp4serve bundle", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
