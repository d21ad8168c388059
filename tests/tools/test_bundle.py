"""The offline GPU bundle (`fp4serve bundle`, fp4serve_tools/bundle.py): the wheel trim, the kernel
plan and names, arch and model checks, the pip download, and the bundle end to end from a local
wheel folder."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ConfigError
from fp4serve_tools import bundle


@pytest.mark.parametrize(
    ("path", "kept"),
    [
        ("flashinfer/decode.py", True),
        ("flashinfer/experimental/x/y.py", True),
        ("flashinfer_python-0.7.2.post1.dist-info/METADATA", True),
        ("flashinfer/data/build_backend.py", True),
        ("flashinfer/data/csrc/batch_decode.cu", True),
        ("flashinfer/data/csrc/batch_prefill_sm90.jinja", True),
        ("flashinfer/data/csrc/fused_moe/x.cu", False),
        ("flashinfer/data/csrc/nv_internal/a/b.h", False),
        ("flashinfer/data/include/flashinfer/page.cuh", True),
        ("flashinfer/data/cutlass/include/cute/x.hpp", True),
        ("flashinfer/data/cutlass/tools/util/include/cutlass/util/a.h", True),
        ("flashinfer/data/cutlass/examples/a.cu", False),
        ("flashinfer/data/cutlass/python/a.py", False),
        ("flashinfer/data/cccl/cub/cub/a.cuh", True),
        ("flashinfer/data/cccl/libcudacxx/include/cuda/std/a", True),
        ("flashinfer/data/cccl/thrust/thrust/a.h", True),
        ("flashinfer/data/cccl/python/a.py", False),
        ("flashinfer/data/spdlog/include/spdlog/a.h", True),
        ("flashinfer/data/aot/m/m.so", True),
    ],
)
def test_trim_keeps_python_headers_and_top_level_sources(path: str, kept: bool) -> None:
    assert bundle.keep_in_wheel(path) is kept


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes] | None = None) -> Path:
    """A minimal valid py3-none-any wheel."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    entries = {
        **(files or {}),
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in [*entries, f"{dist}.dist-info/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for n, data in entries.items():
            z.writestr(n, data)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


FAKE_FLASHINFER = {
    "flashinfer/__init__.py": b"__version__ = '0.7.2.post1'\n",
    "flashinfer/data/csrc/batch_decode.cu": b"// decode\n",
    "flashinfer/data/csrc/fused_moe/big.cu": b"x" * 5000,
    "flashinfer/data/include/flashinfer/page.cuh": b"// page\n",
    "flashinfer/data/cutlass/examples/e.cu": b"y" * 300,
}


def test_trimmed_wheel_has_a_record_of_exactly_its_files(tmp_path: Path) -> None:
    src = make_wheel(tmp_path, "flashinfer-python", "0.7.2.post1", FAKE_FLASHINFER)
    (tmp_path / "out").mkdir()
    so = b"\x7fELF prebuilt"
    report = bundle.trim_wheel(src, tmp_path / "out" / src.name, {bundle.aot_name("mod"): so})
    assert (report.dropped_files, report.dropped_bytes) == (2, 5300)
    with zipfile.ZipFile(tmp_path / "out" / src.name) as z:
        names = set(z.namelist())
        record = z.read("flashinfer_python-0.7.2.post1.dist-info/RECORD").decode().splitlines()
        files = {n: z.read(n) for n in names}
    assert "flashinfer/data/csrc/fused_moe/big.cu" not in names and "flashinfer/data/aot/mod/mod.so" in names
    assert report.kept_files == len(names) - 1 == 6
    digest = lambda data: base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()  # noqa: E731
    want = {f"{n},sha256={digest(d)},{len(d)}" for n, d in files.items() if not n.endswith("RECORD")}
    assert set(record) == want | {"flashinfer_python-0.7.2.post1.dist-info/RECORD,,"}


def test_kernel_module_names_are_flashinfers() -> None:
    common = (
        "dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_128_head_dim_vo_128_posenc_0_"
        "use_swa_False_use_logits_cap_False"
    )
    assert bundle.KernelSpec("decode", "fa2", "bfloat16", 128).module == f"batch_decode_with_kv_cache_{common}"
    assert (
        bundle.KernelSpec("prefill", "fa3", "bfloat16", 128).module
        == f"batch_prefill_with_kv_cache_{common}_f16qk_False_sm90"
    )
    assert (
        bundle.KernelSpec("prefill", "fa2", "bfloat16", 128).module
        == f"batch_prefill_with_kv_cache_{common}_f16qk_False_kv_stride_equal"
    )
    assert "dtype_q_f16_" in bundle.KernelSpec("decode", "fa2", "float16", 64).module


def test_the_kernel_plan_is_what_the_backend_loads_for_each_shape() -> None:
    qwen = bundle.DEFAULT_SHAPE
    llama70 = bundle.ModelShape("l70", 64, 8, 128, "bfloat16")  # group 8: tensor-core decode
    small = bundle.ModelShape("s", 16, 8, 64, "float16")
    K = bundle.KernelSpec
    assert bundle.plan_kernels([qwen, llama70, small, qwen], "sm_90a") == [
        K("decode", "fa2", "bfloat16", 128),
        K("prefill", "fa3", "bfloat16", 128),
        K("prefill", "fa2", "bfloat16", 128),
        K("decode", "fa2", "float16", 64),
        K("prefill", "fa3", "float16", 64),
    ]
    assert bundle.plan_kernels([qwen], "sm_100a") == [
        K("decode", "fa2", "bfloat16", 128),
        K("prefill", "fa2", "bfloat16", 128),
    ]


@pytest.mark.parametrize(
    ("arch", "parsed"),
    [
        ("sm_90a", ((9, 0), "9.0a")),
        ("sm_100a", ((10, 0), "10.0a")),
        ("sm_80", ((8, 0), "8.0")),
        ("sm_120f", ((12, 0), "12.0f")),
    ],
)
def test_arch_names_map_to_capability_and_flashinfer_arch_list(arch: str, parsed: tuple[Any, str]) -> None:
    assert bundle.parse_arch(arch) == parsed


def test_a_bad_arch_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--arch: 'hopper'"):
        bundle.parse_arch("hopper")


def _config_json(folder: Path, **fields: Any) -> Path:
    folder.mkdir()
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        **fields,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_model_shape_reads_heads_and_the_gpu_dtype(tmp_path: Path) -> None:
    path = _config_json(tmp_path / "m", head_dim=128, torch_dtype="float16")
    assert bundle.model_shape(path) == bundle.ModelShape("m", 4, 2, 128, "float16")
    assert bundle.model_shape(_config_json(tmp_path / "b", torch_dtype="float32")).dtype == "bfloat16"


def test_a_model_flashinfer_does_not_cover_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not cover head_dim 16"):
        bundle.model_shape(_config_json(tmp_path / "tiny", head_dim=16))


def test_pip_downloads_cp312_manylinux_binaries(tmp_path: Path) -> None:
    cmd = bundle.pip_download_command(["ninja"], tmp_path, no_deps=True)
    assert cmd == [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--dest",
        str(tmp_path),
        "--platform",
        "manylinux2014_x86_64",
        "--platform",
        "manylinux_2_17_x86_64",
        "--platform",
        "manylinux_2_28_x86_64",
        "--no-deps",
        "ninja",
    ]


def test_bundle_end_to_end_from_a_local_wheel_folder(tmp_path: Path) -> None:
    links = tmp_path / "links"
    links.mkdir()
    make_wheel(links, "flashinfer-python", "0.7.2.post1", FAKE_FLASHINFER)
    for name, version in [
        ("apache-tvm-ffi", "0.1.15"),
        ("nvidia-ml-py", "13.0"),
        ("ninja", "1.13"),
        ("requests", "2.34"),
        ("tqdm", "4.70"),
        ("packaging", "26.0"),
    ]:
        make_wheel(links, name, version)
    out = tmp_path / "bundle"
    assert bundle.main(["--out", str(out), "--no-build", "--find-links", str(links)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(w["name"] for w in manifest["wheels"]) == [
        "apache-tvm-ffi",
        "flashinfer-python",
        "ninja",
        "nvidia-ml-py",
        "packaging",
        "requests",
        "tqdm",
    ]
    assert manifest["flashinfer"]["dropped_files"] == 2
    assert [(k["kind"], k["backend"], k["prebuilt"]) for k in manifest["kernels"]] == [
        ("decode", "fa2", False),
        ("prefill", "fa3", False),
    ]
    script = (out / "install.sh").read_text()
    assert "--no-deps apache-tvm-ffi==0.1.15\n" in script
    assert "--no-deps ninja nvidia-ml-py packaging requests tqdm\n" in script
    assert subprocess.run(["bash", "-n", str(out / "install.sh")]).returncode == 0
    with zipfile.ZipFile(out / "wheels" / "flashinfer_python-0.7.2.post1-py3-none-any.whl") as z:
        assert "flashinfer/data/csrc/batch_decode.cu" in z.namelist()
        assert "flashinfer/data/csrc/fused_moe/big.cu" not in z.namelist()


def test_the_bundle_command_parses_its_documented_flags() -> None:
    parser = argparse.ArgumentParser()
    bundle.add_arguments(parser)
    args = parser.parse_args(["--out", "d", "--model", "a", "b", "--arch", "sm_100a", "--no-build"])
    assert (args.out, args.model, args.arch, args.no_build) == (Path("d"), [Path("a"), Path("b")], "sm_100a", True)
