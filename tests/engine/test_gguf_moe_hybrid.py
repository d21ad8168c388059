"""GGUF files of Qwen3-MoE (`qwen3moe`) and the Qwen3.5/3.6 hybrids (`qwen35`, `qwen35moe`), written
by llama.cpp's converter's rules (tests/gguf_factory.py write_llamacpp_gguf), converted back into
HF folders: every tensor returns to the checkpoint it was written from (the norms llama.cpp stored
as w + 1 and A_log stored as -exp(A_log) within one float32 rounding), bit for bit what
transformers' own GGUF loader makes of the hybrids, and greedy output equals transformers on the
original checkpoint token for token, MTP head included."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.errors import ConfigError
from engine.weights.formats.gguf import ensure_gguf_checkpoint
from scheduler.request import SamplingParams
from tests.engine.test_engine_correctness import make_engine
from tests.engine.test_fp8_engine import prompts, transformers_greedy
from tests.factories import make_hybrid_checkpoint, make_hybrid_moe_checkpoint, make_moe_checkpoint
from tests.gguf_factory import write_llamacpp_gguf
from tests.mtp_factory import add_mtp_tensors

MAKERS: dict[str, Callable[[Path], Path]] = {
    "qwen3moe": lambda p: make_moe_checkpoint(p),
    "qwen35-mtp": lambda p: add_mtp_tensors(make_hybrid_checkpoint(p, seed=2)),
    "qwen35-vl": lambda p: make_hybrid_checkpoint(p, layout="vl", seed=3),
    "qwen35moe": lambda p: make_hybrid_moe_checkpoint(p, seed=1),
    "qwen35moe-vl-tied": lambda p: make_hybrid_moe_checkpoint(p, layout="vl", tie=True, seed=4),
}
# Written as w + 1 or -exp(w) by llama.cpp: back within one float32 rounding of w.
_ROUNDED = ("norm.weight", "A_log", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


Built = tuple[str, Path, Path, Path]  # (kind, source checkpoint, .gguf file, converted folder)


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    """Each kind's checkpoint, GGUF and converted folder, made once for the module."""
    made: dict[str, Built] = {}

    def get(kind: str) -> Built:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"gguf-{kind}")
            src = MAKERS[kind](root / "src")
            path = write_llamacpp_gguf(src, root / f"{kind}.gguf")
            made[kind] = (kind, src, path, ensure_gguf_checkpoint(path, root / "cache"))
        return made[kind]

    return get


@pytest.fixture(params=list(MAKERS))
def gguf_file(request: pytest.FixtureRequest, build: Callable[[str], Built]) -> Built:
    return build(request.param)


def test_every_tensor_comes_back_to_the_checkpoint_it_was_written_from(gguf_file: tuple[str, Path, Path, Path]) -> None:
    kind, src, _, folder = gguf_file
    want = {
        n.replace("model.language_model.", "model."): t
        for n, t in load_file(str(src / "model.safetensors")).items()
        if not n.startswith("model.visual.")
    }
    if json.loads((src / "config.json").read_text()).get("tie_word_embeddings"):
        want.pop("lm_head.weight", None)
    got = load_file(str(folder / "model.safetensors"))
    assert sorted(got) == sorted(want), kind
    for name, value in want.items():
        assert got[name].shape == value.shape, name
        if name.endswith(_ROUNDED) and "linear_attn.norm" not in name and kind != "qwen3moe":
            assert torch.allclose(got[name], value, rtol=0, atol=1.2e-7), name
        else:
            assert torch.equal(got[name], value), name


@pytest.mark.parametrize("kind", [k for k in MAKERS if k != "qwen3moe"])
def test_hybrids_convert_to_what_transformers_own_gguf_loader_reads(kind: str, build: Callable[[str], Built]) -> None:
    """transformers 5.24 reads qwen35 / qwen35moe GGUFs itself (its qwen35 conversion mapping): every
    weight it loads equals ours, bit for bit. (Its qwen3moe reading has no expert width, so that
    architecture is checked against the source checkpoint only.)"""
    import transformers

    _, _, path, folder = build(kind)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert sorted(theirs) == sorted(ours)
    for name, value in ours.items():
        assert torch.equal(theirs[name], value), name


def test_greedy_output_equals_transformers_on_the_source_checkpoint(gguf_file: tuple[str, Path, Path, Path]) -> None:
    kind, src, path, _ = gguf_file
    ps = prompts(seed=7)
    got = [
        r.token_ids[0]
        for r in make_engine(path).generate(ps, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    ]
    assert got == transformers_greedy(src, ps, 8), kind


def test_converted_config(gguf_file: tuple[str, Path, Path, Path]) -> None:
    kind, src, _, folder = gguf_file
    config = json.loads((folder / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    source = {**source, **source.get("text_config", {})}
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    ):
        assert config[key] == source[key], key
    if kind == "qwen3moe":
        assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["norm_topk_prob"] is True
        assert (config["num_experts"], config["moe_intermediate_size"]) == (8, 32)
        return
    assert config["layer_types"] == source["layer_types"]
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
        assert config[key] == source[key], key
    if "moe" in kind:
        assert config["architectures"] == ["Qwen3_5MoeForCausalLM"]
        assert (config["shared_expert_intermediate_size"], config["moe_intermediate_size"]) == (48, 32)
    assert config.get("mtp_num_hidden_layers", 0) == (1 if kind == "qwen35-mtp" else 0)


def test_the_mtp_block_drafts_from_the_gguf(tmp_path: Path) -> None:
    """A qwen35 GGUF with llama.cpp's nextn block: `--speculative-method mtp` serves it, exactly."""
    src = add_mtp_tensors(make_hybrid_checkpoint(tmp_path / "src", seed=5))
    path = write_llamacpp_gguf(src, tmp_path / "m.gguf")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ps = prompts(seed=8)[1:3]
    plain = [r.token_ids for r in make_engine(path, enable_prefix_caching=False).generate(ps, params)]
    engine = make_engine(
        path, speculative_method="mtp", num_speculative_tokens=2, speculative_max_batch=8, enable_prefix_caching=False
    )
    assert [r.token_ids for r in engine.generate(ps, params)] == plain


def test_quantized_hybrid_moe_gguf(tmp_path: Path) -> None:
    """Q8_0 weights (experts stacked in 3-D included): dequantized by the gguf package, then the
    same transforms; the result is transformers' own reading of the file, and it serves."""
    import transformers

    src = make_hybrid_moe_checkpoint(tmp_path / "src", seed=6)
    path = write_llamacpp_gguf(src, tmp_path / "q8.gguf", quant="Q8_0")
    folder = ensure_gguf_checkpoint(path, tmp_path / "cache")
    got = load_file(str(folder / "model.safetensors"))
    original = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert not torch.equal(got[name], original[name]) and torch.allclose(got[name], original[name], atol=2e-3)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ps = prompts(seed=9)[:2]
    assert [
        r.token_ids[0]
        for r in make_engine(path).generate(ps, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    ] == [
        theirs.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in ps
    ]


def without_keys(src: Path, dst: Path, drop: set[str]) -> Path:
    """A copy of GGUF `src` without the metadata keys in `drop`."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        writer.add_key_value(
            key, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None
        )
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data.copy(), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_missing_metadata_fails_start_up_with_one_line(tmp_path: Path) -> None:
    full = write_llamacpp_gguf(make_hybrid_checkpoint(tmp_path / "src"), tmp_path / "full.gguf")
    bad = without_keys(full, tmp_path / "bad.gguf", {"qwen35.ssm.time_step_rank"})
    with pytest.raises(ConfigError, match=r"GGUF metadata key 'qwen35\.ssm\.time_step_rank' is missing") as e:
        make_engine(bad)
    assert "\n" not in str(e.value)


def test_expert_widths_come_from_the_tensors_when_the_keys_are_absent(tmp_path: Path) -> None:
    src = make_hybrid_moe_checkpoint(tmp_path / "src", seed=7)
    full = write_llamacpp_gguf(src, tmp_path / "full.gguf")
    path = without_keys(
        full,
        tmp_path / "lean.gguf",
        {"qwen35moe.expert_feed_forward_length", "qwen35moe.expert_shared_feed_forward_length"},
    )
    config = json.loads((ensure_gguf_checkpoint(path, tmp_path / "cache") / "config.json").read_text())
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"]) == (32, 48)
