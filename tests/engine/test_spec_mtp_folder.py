"""The MTP head from a second checkpoint folder (`--speculative-model`, FlashRT's setup): an NVFP4
Qwen3.5 body written by `fp4serve quantize` from a checkpoint without `mtp.*`, and the FP8 release
of the same model (tests/fp8_factory.py) holding the head. The head drafts exactly as the same
head placed inside the body's checkpoint (dequantized by the test factory) does, greedy output with
speculation equals the body's without it, and a second folder of another model fails start-up with
one line; vLLM's `--speculative-config` JSON says the same."""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from api.cli import build_parser, server_config
from bench.spec_decode import record_steps
from engine.errors import ConfigError
from engine.spec_decode.config import speculative_config_fields
from fp4serve_tools.quantize import quantize_checkpoint
from scheduler.request import SamplingParams
from tests.engine.test_spec_decode import make_engine, num_accepted
from tests.engine.test_spec_mtp import K, mtp_engine, random_prompts, record_drafts
from tests.factories import make_hybrid_checkpoint
from tests.fp8_factory import block_dequantize, to_fp8_checkpoint
from tests.mtp_factory import add_mtp_tensors, make_predictable


def split_release(full: Path, root: Path) -> tuple[Path, Path]:
    """(NVFP4 body without mtp.*, FP8 checkpoint with it) of the float checkpoint `full`."""
    stripped = root / "body-float"
    shutil.copytree(full, stripped)
    tensors = load_file(str(stripped / "model.safetensors"))
    save_file(
        {n: t for n, t in tensors.items() if not n.startswith("mtp.")},
        str(stripped / "model.safetensors"),
        metadata={"format": "pt"},
    )
    body = root / "body-nvfp4"
    quantize_checkpoint(stripped, body, "modelopt", torch.device("cpu"))
    return body, to_fp8_checkpoint(full, root / "fp8")


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(NVFP4 body, FP8 release, the body with the dequantized FP8 head inside its checkpoint)."""
    root = tmp_path_factory.mktemp("mtp-folder")
    body, fp8 = split_release(add_mtp_tensors(make_hybrid_checkpoint(root / "full", seed=6)), root)
    inside = root / "body-with-head"
    shutil.copytree(body, inside)
    tensors = load_file(str(inside / "model.safetensors"))
    head = load_file(str(fp8 / "model.safetensors"))
    for name, value in head.items():
        if name.startswith("mtp.") and not name.endswith("_scale_inv"):
            scale = head.get(name.removesuffix(".weight") + ".weight_scale_inv")
            tensors[name] = block_dequantize(value, scale) if scale is not None else value
    save_file(tensors, str(inside / "model.safetensors"), metadata={"format": "pt"})
    return body, fp8, inside


def test_body_has_no_head_and_the_release_has_it_in_fp8(release: tuple[Path, Path, Path]) -> None:
    body, fp8, _ = release
    assert not any(n.startswith("mtp.") for n in load_file(str(body / "model.safetensors")))
    head = load_file(str(fp8 / "model.safetensors"))
    assert head["mtp.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert "mtp.layers.0.self_attn.q_proj.weight_scale_inv" in head
    with pytest.raises(
        ConfigError, match=r"has no mtp\.\* tensors .*--speculative-model PATH, or use --speculative-method ngram"
    ):
        mtp_engine(body)


def test_head_from_the_second_folder_drafts_as_the_same_head_inside_the_checkpoint(
    release: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    body, fp8, inside = release
    ps = random_prompts(5, 19, 33, seed=11)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="fp4serve.loader"):
        engine = mtp_engine(body, speculative_model=str(fp8), max_num_batched_tokens=24)
    assert any(
        f"MTP head loaded: 15 mtp.* tensors from {fp8} (FP8, dequantized)" in r.getMessage() for r in caplog.records
    )
    calls = record_drafts(engine)
    got = engine.generate(ps, params)
    twin = mtp_engine(inside, max_num_batched_tokens=24)
    twin_calls = record_drafts(twin)
    assert [r.token_ids for r in twin.generate(ps, params)] == [r.token_ids for r in got]
    assert calls == twin_calls and sum(len(d) for _, _, d in calls) > 0
    plain = make_engine(body, enable_prefix_caching=False).generate(ps, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]


def test_greedy_output_is_exact_with_acceptances_and_rejections(tmp_path: Path) -> None:
    full = make_predictable(add_mtp_tensors(make_hybrid_checkpoint(tmp_path / "full", seed=4)))
    body, fp8 = split_release(full, tmp_path)
    ps = random_prompts(3, 14, 30, 41, seed=5)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ref = make_engine(body, enable_prefix_caching=False).generate(ps, params)
    engine = mtp_engine(body, speculative_model=str(fp8))
    steps = record_steps(engine)
    got = engine.generate(ps, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    drafted = sum(sum(s.num_drafts_by_position) for s in steps)
    assert 0 < num_accepted(steps) < drafted, "drafts both accepted and rejected"


def test_a_second_folder_of_another_model_fails_start_up_with_one_line(
    release: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    body, _, _ = release
    wider = add_mtp_tensors(make_hybrid_checkpoint(tmp_path / "wider", vocab_size=1024))
    cases = [
        (wider, r"--speculative-model .*wider: vocab_size is 1024 in its config\.json, 512 in the model's"),
        (make_hybrid_checkpoint(tmp_path / "headless"), r"--speculative-model .*headless: has no mtp\.\* tensors"),
        (tmp_path / "nowhere", r"--speculative-model .*nowhere: not a local checkpoint folder"),
    ]
    bad_shape = add_mtp_tensors(make_hybrid_checkpoint(tmp_path / "bad"))
    tensors = load_file(str(bad_shape / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(bad_shape / "model.safetensors"), metadata={"format": "pt"})
    cases.append(
        (
            bad_shape,
            r"--speculative-model .*bad: tensor 'mtp\.fc\.weight' has shape \[64, 64\], "
            r"expected \[64, 128\]$",
        )
    )
    for folder, message in cases:
        with pytest.raises(ConfigError, match=message) as e:
            mtp_engine(body, speculative_model=str(folder))
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--speculative-model: .* needs --speculative-method mtp, not ngram"):
        make_engine(body, speculative_method="ngram", speculative_model=str(wider))


def parse(*flags: str) -> argparse.Namespace:
    return build_parser(["serve"]).parse_args(["serve", *flags])


def test_vllm_speculative_config_sets_the_same_fields() -> None:
    assert speculative_config_fields('{"method": "qwen3_next_mtp", "num_speculative_tokens": 2, "model": "/m"}') == {
        "speculative_method": "mtp",
        "num_speculative_tokens": 2,
        "speculative_model": "/m",
    }
    assert speculative_config_fields(
        '{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
        '"disable_by_batch_size": 16, "draft_tensor_parallel_size": 1}'
    ) == {"speculative_method": "ngram", "ngram_min": 1, "ngram_max": 3, "speculative_max_batch": 16}
    engine = server_config(parse("--speculative-config", '{"model": "/fp8", "num_speculative_tokens": 3}')).engine
    assert (engine.speculative_method, engine.speculative_model, engine.num_speculative_tokens) == ("mtp", "/fp8", K)
    engine = server_config(parse("--speculative-model", "/fp8")).engine
    assert (engine.speculative_method, engine.speculative_model) == ("mtp", "/fp8")
    for flags, message in [
        (("--speculative-config", '{"method": "eagle3"}', "--speculative-method", "mtp"), "sets method"),
        (("--speculative-config", '{"quantization": "fp8"}'), "unsupported key 'quantization'"),
        (("--speculative-config", "[1]"), "must be a JSON object"),
        (("--speculative-config", '{"num_speculative_tokens": "3"}'), "'num_speculative_tokens' must be an integer"),
    ]:
        with pytest.raises(ConfigError, match=message):
            server_config(parse(*flags))
