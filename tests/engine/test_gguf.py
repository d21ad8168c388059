"""GGUF files as `--model`: converted once, atomically, into the cache; the converted folder holds
exactly the weights, config and tokenizer the file was written from; bad files fail with one
line naming the problem."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.front.offline import OfflineEngine
from engine.host import cache_folder
from engine.host.cache_folder import MARKER_FILE, build_once, is_complete
from engine.weights.formats import gguf as gguf_module
from engine.weights.formats.gguf import ensure_gguf_checkpoint, gguf_cache_folder, unpermute_qk
from scheduler.request import SamplingParams
from tests.factories import make_checkpoint
from tests.gguf_factory import CHATML, permute_qk, write_gguf

CFG = dict(dtype="float32", kv_cache_memory="4MiB")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-src")
    return {
        "llama": make_checkpoint(root / "llama", "llama", tie=False),
        "qwen3": make_checkpoint(root / "qwen3", "qwen3"),
    }


def greedy(path: Path | str, prompt: list[int]) -> list[int]:
    engine = OfflineEngine.from_config(EngineConfig(model=str(path), **CFG))
    [out] = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    return out.token_ids[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_gguf_converts_back_to_the_exact_checkpoint_it_was_written_from(
    arch: str, ckpts: dict[str, Path], tmp_path: Path
) -> None:
    src = ckpts[arch]
    folder = ensure_gguf_checkpoint(write_gguf(src, tmp_path / f"{arch}.gguf"), tmp_path / "cache")
    want, got = load_file(str(src / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:  # llama's q/k come back in HF row order
        assert torch.equal(got[name], want[name]), name
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert (config["head_dim"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (
        16,
        2,
        arch == "qwen3",
    )
    assert "quantization_config" not in config
    prompt = [5, 17, 300, 42, 8]
    assert greedy(tmp_path / f"{arch}.gguf", prompt) == greedy(src, prompt)


def test_tokenizer_and_chat_template_come_from_the_gguf_metadata(ckpts: dict[str, Path], tmp_path: Path) -> None:
    from engine.front.tokenizer import Tokenizer

    folder = ensure_gguf_checkpoint(write_gguf(ckpts["qwen3"], tmp_path / "m.gguf"), tmp_path / "cache")
    tokenizer = Tokenizer(folder)
    assert tokenizer.chat_template == CHATML
    assert tokenizer.hf.eos_token == "<|im_end|>" and 511 in tokenizer.eos_token_ids
    ids = tokenizer.hf.encode("the north")
    assert tokenizer.hf.decode(ids) == "the north" and len(ids) < len("the north")  # merges applied
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [511]


def test_llama_qk_unpermute_undoes_llama_cpp_and_matches_transformers() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(0).standard_normal((6 * 16, 32)).astype(np.float32)
    assert np.array_equal(unpermute_qk(permute_qk(w, 6), 6), w)
    reference = LlamaTensorProcessor(config={})._reverse_permute_weights(permute_qk(w, 6), 6, 6)
    assert np.array_equal(unpermute_qk(permute_qk(w, 6), 6), reference)


def test_quantized_tensors_are_dequantized_by_the_gguf_package(ckpts: dict[str, Path], tmp_path: Path) -> None:
    import gguf

    src = ckpts["qwen3"]
    folder = ensure_gguf_checkpoint(write_gguf(src, tmp_path / "q8.gguf", quant="Q8_0"), tmp_path / "cache")
    want = load_file(str(src / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"].numpy()
    expected = gguf.quants.dequantize(
        gguf.quants.quantize(want, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    )
    got = load_file(str(folder / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"].numpy()
    assert np.array_equal(got, expected) and not np.array_equal(got, want)


def test_later_starts_load_the_cached_folder_without_converting(
    ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(ckpts["qwen3"], tmp_path / "m.gguf")
    first = ensure_gguf_checkpoint(path, tmp_path / "cache")

    def fail(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_module, "convert_gguf", fail)
    assert ensure_gguf_checkpoint(path, tmp_path / "cache") == first
    write_gguf(ckpts["llama"], path)  # a new file at the same path is a new cache entry
    with pytest.raises(AssertionError, match="converted again"):
        ensure_gguf_checkpoint(path, tmp_path / "cache")


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_failed_build_leaves_neither_the_folder_nor_its_staging(tmp_path: Path) -> None:
    final = tmp_path / "m"

    def half_then_fail(staging: Path) -> None:
        (staging / "model.safetensors").write_bytes(b"x" * 100)
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        build_once(final, half_then_fail)
    assert list(tmp_path.iterdir()) == []


def test_staging_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    final = tmp_path / "m"
    stale = tmp_path / f".m.tmp-{dead_pid()}-abcd1234"
    live = tmp_path / ".m.tmp-1-abcd1234"  # pid 1 is always alive: another process still building
    for folder in (stale, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    build_once(final, lambda staging: (staging / "a.txt").write_text("done"))
    assert not stale.exists() and live.exists()
    assert is_complete(final) and (final / "a.txt").read_text() == "done"
    assert sorted(json.loads((final / MARKER_FILE).read_text())["files"]) == ["a.txt"]


def test_a_damaged_cached_folder_is_rebuilt(tmp_path: Path) -> None:
    final = build_once(tmp_path / "m", lambda staging: (staging / "a.txt").write_text("done"))
    (final / "a.txt").write_text("truncated by hand")
    assert not is_complete(final)
    build_once(final, lambda staging: (staging / "a.txt").write_text("done"))
    assert is_complete(final) and (final / "a.txt").read_text() == "done"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (
            "architecture",
            r"unsupported GGUF architecture 'gpt2'; supported: llama, qwen3, qwen3moe, qwen35, qwen35moe$",
        ),
        ("quant", r"unsupported GGUF quant type Q8_1 \(tensor blk\.0\.attn_q\.weight\)$"),
        ("not-gguf", r"not a readable GGUF file \(.*\)$"),
        ("truncated", r"not a readable GGUF file \(.*\)$"),
        ("missing", r"--model .*missing\.gguf: no such file$"),
    ],
)
def test_bad_files_fail_start_up_with_one_line_naming_the_problem(
    kind: str, message: str, ckpts: dict[str, Path], tmp_path: Path
) -> None:
    path = tmp_path / ("missing.gguf" if kind == "missing" else "bad.gguf")
    if kind == "architecture":
        write_gguf(ckpts["llama"], path, arch="gpt2")
    elif kind == "quant":
        write_gguf(ckpts["llama"], path, raw_types={"blk.0.attn_q.weight": "Q8_1"})
    elif kind == "not-gguf":
        path.write_bytes(b"PK\x03\x04 this is a zip file, not a gguf" * 10)
    elif kind == "truncated":
        data = write_gguf(ckpts["llama"], tmp_path / "whole.gguf").read_bytes()
        path.write_bytes(data[: len(data) // 3])
    with pytest.raises(ConfigError, match=message) as error:
        OfflineEngine.from_config(EngineConfig(model=str(path), **CFG))
    assert "\n" not in str(error.value)
    cache = cache_folder.cache_root() / "gguf"
    if kind != "missing":  # nothing half-built is left behind
        assert not list(cache.glob(f".{gguf_cache_folder(path).name}*"))
