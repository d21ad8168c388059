"""Test factories: tiny seeded random-weight checkpoints of real architectures, saved by
transformers' `save_pretrained`, with a small word-level tokenizer, and request makers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, SamplingParams

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
EOS_ID = 511


def write_word_tokenizer(dst: Path, vocab_size: int) -> None:
    """Words w0..w{V-2} and an <eos> special token; decoding joins words with spaces."""
    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    tok.add_special_tokens(["<eos>"])
    tok.save(str(dst / "tokenizer.json"))
    template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<eos>",
                "chat_template": template,
                "model_max_length": 512,
            }
        )
    )


def make_checkpoint(
    dst: Path,
    arch: str = "qwen3",
    rope_scaling: dict[str, Any] | None = None,
    tie: bool = True,
    seed: int = 0,
    init_std: float = 0.1,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """A tiny random model of `arch` ("qwen3" | "llama") saved as an HF checkpoint folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    dst.mkdir(parents=True, exist_ok=True)
    kwargs = {
        **TINY,
        **overrides,
        "tie_word_embeddings": tie,
        "eos_token_id": EOS_ID,
        "bos_token_id": 0,
        "initializer_range": init_std,
        "rms_norm_eps": 1e-6,
    }
    if rope_scaling is not None:
        kwargs["rope_scaling"] = {**rope_scaling, "rope_theta": 10000.0}
    cfg = Qwen3Config(**kwargs) if arch == "qwen3" else LlamaConfig(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # non-trivial norm weights, so a wrongly applied norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(dst, safe_serialization=True)
    write_word_tokenizer(dst, kwargs["vocab_size"])
    return dst


def make_request(request_id: str, prompt: list[int] | int, max_tokens: int = 16, **params: Any) -> Request:
    prompt_ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return Request(request_id, prompt_ids, SamplingParams(max_tokens=max_tokens, **params))


TINY_HYBRID = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)


def make_hybrid_checkpoint(
    dst: Path,
    layout: str = "causal",
    tie: bool = False,
    seed: int = 0,
    init_std: float = 0.05,
    dtype: torch.dtype = torch.float32,
    chat_template: str | None = None,
    **overrides: Any,
) -> Path:
    """A tiny random Qwen3.5 hybrid (Gated DeltaNet + gated attention) saved as an HF checkpoint:
    layout "causal" is Qwen3_5ForCausalLM (model.*), "vl" is Qwen3_5ForConditionalGeneration
    (model.language_model.* beside a 1-layer vision tower). With `chat_template`, the tokenizer is
    Qwen's (vocab_size must cover its 151,669 ids), as transformers loads Qwen3.5 checkpoints with
    Qwen3_5Tokenizer whatever tokenizer_class says; otherwise the word-level test tokenizer."""
    return _save_hybrid(dst, False, layout, tie, seed, init_std, dtype, chat_template, overrides)


HYBRID_MOE_TINY = dict(
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2
)


def make_hybrid_moe_checkpoint(
    dst: Path,
    layout: str = "causal",
    tie: bool = False,
    seed: int = 0,
    init_std: float = 0.05,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """A tiny random Qwen3.5-MoE (the hybrid layers with a sparse MoE block and a sigmoid-gated
    shared expert in every layer): "causal" is Qwen3_5MoeForCausalLM, "vl" is
    Qwen3_5MoeForConditionalGeneration with a 1-layer vision tower."""
    return _save_hybrid(dst, True, layout, tie, seed, init_std, dtype, None, {**HYBRID_MOE_TINY, **overrides})


def _save_hybrid(
    dst: Path,
    moe: bool,
    layout: str,
    tie: bool,
    seed: int,
    init_std: float,
    dtype: torch.dtype,
    chat_template: str | None,
    overrides: dict[str, Any],
) -> Path:
    import transformers

    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    dst.mkdir(parents=True, exist_ok=True)
    tiny = {k: v for k, v in TINY_HYBRID.items() if not (moe and k == "intermediate_size")}  # MoE: no dense MLP
    text = {
        **tiny,
        **overrides,
        "tie_word_embeddings": tie,
        "eos_token_id": EOS_ID,
        "bos_token_id": 0,
        "initializer_range": init_std,
        "rms_norm_eps": 1e-6,
    }
    torch.manual_seed(seed)
    if layout == "causal":
        cfg: Any = getattr(transformers, f"{prefix}TextConfig")(**text)
        model: Any = getattr(transformers, f"{prefix}ForCausalLM")(cfg)
    else:
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=text["hidden_size"],
            patch_size=4,
            temporal_patch_size=2,
            spatial_merge_size=2,
            num_position_embeddings=16,
        )
        cfg = getattr(transformers, f"{prefix}Config")(text_config=text, vision_config=vision, tie_word_embeddings=tie)
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg)
    model = model.to(dtype)
    with torch.no_grad():  # non-trivial norms and gates, so a wrongly applied one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # zero-centred RMSNorms (1 + w) and the gated norm (w) alike: ~N(1, 0.2) or N(0, 0.2)
                p.copy_((0.0 if "linear_attn.norm" not in name else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # spread the router so top-k choices differ by token
                p.copy_(torch.randn_like(p))
            elif name.endswith("shared_expert_gate.weight"):  # a gate well away from a constant 0.5
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(dst, safe_serialization=True)
    if chat_template is None:
        write_word_tokenizer(dst, text["vocab_size"])
    else:
        from engine.weights.qwen_tokenizer import write_qwen_tokenizer_files

        write_qwen_tokenizer_files(dst, chat_template)
    return dst


MOE_TINY = dict(
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def make_moe_checkpoint(
    dst: Path, seed: int = 0, fused_experts: bool = False, tie: bool = False, init_std: float = 0.1, **overrides: Any
) -> Path:
    """A tiny random Qwen3MoeForCausalLM (transformers' own classes). `fused_experts`: rewrite the
    per-expert tensors save_pretrained writes as fused `mlp.experts.gate_up_proj` [E, 2I, H] and
    `mlp.experts.down_proj` [E, H, I], the layout some tools write."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dst.mkdir(parents=True, exist_ok=True)
    kwargs = {
        **TINY,
        **MOE_TINY,
        "num_hidden_layers": 3,
        **overrides,
        "tie_word_embeddings": tie,
        "eos_token_id": EOS_ID,
        "bos_token_id": 0,
        "initializer_range": init_std,
        "rms_norm_eps": 1e-6,
    }
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kwargs)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # spread the router so top-k choices differ by token
                p.copy_(torch.randn_like(p))
    model.save_pretrained(dst, safe_serialization=True)
    if fused_experts:
        [weights_file] = list(dst.glob("*.safetensors"))
        tensors = load_file(weights_file)
        for layer in range(kwargs["num_hidden_layers"]):
            prefix = f"model.layers.{layer}.mlp.experts"
            if f"{prefix}.0.gate_proj.weight" not in tensors:
                continue
            per = {
                p: [tensors.pop(f"{prefix}.{e}.{p}_proj.weight") for e in range(kwargs["num_experts"])]
                for p in ("gate", "up", "down")
            }
            tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(per["gate"], per["up"])])
            tensors[f"{prefix}.down_proj"] = torch.stack(per["down"])
        save_file(tensors, str(weights_file), metadata={"format": "pt"})
    write_word_tokenizer(dst, kwargs["vocab_size"])
    return dst


def scheduled(*reqs: tuple[str, int, int, list[int]]) -> SchedulerOutput:
    """(request id, start_pos, num_new_tokens, block table) -> a SchedulerOutput; token ids are
    derived from the position so repeated runs feed the same tokens."""
    return SchedulerOutput(
        tuple(
            ScheduledRequest(rid, tuple((7 * p + 3) % 500 for p in range(start, start + n)), start, tuple(table), True)
            for rid, start, n, table in reqs
        ),
        (),
    )


def forward_batch(*reqs: tuple[str, int, int, list[int]], block_size: int = 4) -> Any:
    """The CPU ForwardBatch of `scheduled(*reqs)`, with pages of `block_size` tokens."""
    from engine.batch import build_forward_batch

    return build_forward_batch(scheduled(*reqs), block_size, torch.device("cpu"))
