"""`bench context`: the engine's decode step time as the context grows, for comparing a hybrid
(Gated DeltaNet + gated attention) with a dense model of the same width; and `bench tiny-model`,
which writes the random-weight checkpoints such a comparison runs on (transformers' own classes).

A fixed batch of sequences decodes from a short prompt to `--context` tokens; the forward time of
each step (the engine's own timing) is averaged per context window."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

PROMPT_LEN = 16


class _Engine(Protocol):
    """What the curve needs of engine.front.offline.OfflineEngine (imported lazily: bench/ layering)."""

    timings: Any

    def add_request(self, prompt_token_ids: Sequence[int], params: Any) -> str: ...

    def step(self) -> list[Any]: ...

    def has_unfinished(self) -> bool: ...


@dataclass(frozen=True)
class CurvePoint:
    context: int  # tokens per sequence at the window's end
    forward_ms: float  # mean forward time of one decode step in the window
    step_ms: float  # mean whole step (schedule + prepare + forward + sample + update)


def run_context_curve(engine: _Engine, batch_size: int, context: int, window: int) -> list[CurvePoint]:
    """Decode `batch_size` sequences from PROMPT_LEN to `context` tokens; one point per `window`."""
    from scheduler.request import SamplingParams

    assert context > PROMPT_LEN and window >= 1, "context must exceed the prompt; window positive"
    params = SamplingParams(
        max_tokens=context - PROMPT_LEN, min_tokens=context - PROMPT_LEN, ignore_eos=True, temperature=0.0
    )
    for i in range(batch_size):
        engine.add_request([(7 * i + j) % 100 + 1 for j in range(PROMPT_LEN)], params)
    engine.step()  # the prefill step, not part of the curve
    points: list[CurvePoint] = []
    length, forward, total, steps = PROMPT_LEN + 1, 0.0, 0.0, 0
    while engine.has_unfinished():
        before_forward, before_total = engine.timings.forward, engine.timings.total
        engine.step()
        forward += engine.timings.forward - before_forward
        total += engine.timings.total - before_total
        steps += 1
        length += 1
        if steps == window or not engine.has_unfinished():
            points.append(CurvePoint(length, 1000 * forward / steps, 1000 * total / steps))
            forward, total, steps = 0.0, 0.0, 0
    return points


def format_curves(curves: dict[str, list[CurvePoint]]) -> str:
    """One row per context window, one forward-ms column per model, and the ratio of the last to
    the first when two models are compared."""
    names = list(curves)
    header = f"{'context':>8}" + "".join(f"{n + ' fwd ms':>22}" for n in names)
    if len(names) == 2:
        header += f"{names[1] + '/' + names[0]:>22}"
    lines = [header]
    for row in zip(*curves.values()):
        line = f"{row[0].context:>8}" + "".join(f"{p.forward_ms:>22.2f}" for p in row)
        if len(row) == 2:
            line += f"{row[1].forward_ms / row[0].forward_ms:>22.2f}"
        lines.append(line)
    return "\n".join(lines)


def write_tiny_model(dst: Path, kind: str, hidden: int, num_layers: int, seed: int = 0) -> Path:
    """A random-weight checkpoint: kind "dense" (Qwen3ForCausalLM) or "hybrid" (Qwen3_5ForCausalLM,
    3 Gated DeltaNet layers per gated-attention layer), same width and depth, vocab 1024, with a
    word-level tokenizer (w0 .. w1022, <eos>) and a plain chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    vocab, heads = 1024, max(hidden // 64, 1)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        head_dim=64,
        max_position_embeddings=32768,
        eos_token_id=vocab - 1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    if kind == "dense":
        model: torch.nn.Module = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "hybrid":
        model = Qwen3_5ForCausalLM(
            Qwen3_5TextConfig(
                **common,
                linear_num_key_heads=heads,
                linear_num_value_heads=2 * heads,
                linear_key_head_dim=64,
                linear_value_head_dim=64,
            )
        )
    else:
        raise ValueError(f"kind must be dense or hybrid, got {kind!r}")
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst, safe_serialization=True)
    words = {f"w{i}": i for i in range(vocab - 1)} | {"<eos>": vocab - 1}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(dst / "tokenizer.json"))
    # A plain chat template (roles as words), so `bench agent-replay` can chat with it.
    template = (
        "{% for m in messages %}w1 {{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w1 assistant {% endif %}"
    )
    (dst / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "chat_template": template})
    )
    return dst


def curves_for(
    models: Sequence[str], batch_size: int, context: int, window: int, kv_cache_memory: str
) -> dict[str, list[CurvePoint]]:
    from engine.config import EngineConfig
    from engine.front.offline import OfflineEngine

    curves: dict[str, list[CurvePoint]] = {}
    for path in models:
        engine = OfflineEngine.from_config(
            EngineConfig(
                model=path,
                dtype="float32",
                max_num_seqs=batch_size,
                kv_cache_memory=kv_cache_memory,
                max_model_len=context + 1,
            )
        )
        curves[Path(path).name] = run_context_curve(engine, batch_size, context, window)
    return curves
