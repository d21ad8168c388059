"""Random `mtp.*` tensors added to a tiny Qwen3.5 checkpoint (tests/factories.py builds the model
from transformers' config classes; transformers has no MTP module, so its tensors are made here in
the layout and dtype of a real Qwen3.5 checkpoint: fc [H, 2H], three zero-centred norms, and one
full-attention decoder layer shaped like the model's own), plus a dense reference of the MTP maths
that runs transformers' own Qwen3.5 decoder layer (no paging, a causal mask over a whole sequence)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


def _text_prefix(names: list[str]) -> str:
    return "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."


def add_mtp_tensors(ckpt: Path, seed: int = 1, std: float = 0.05) -> Path:
    """Rewrite ckpt's model.safetensors with mtp.* tensors beside the model's; returns ckpt."""
    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    prefix = _text_prefix(list(tensors))
    cfg = _text_config(ckpt)
    full = cfg["layer_types"].index("full_attention")
    layer_prefix = f"{prefix}layers.{full}."
    g = torch.Generator().manual_seed(seed)
    dtype = tensors[f"{prefix}embed_tokens.weight"].dtype
    hidden = cfg["hidden_size"]

    def rand(shape: tuple[int, ...], norm: bool) -> torch.Tensor:
        scale = 0.2 if norm else std  # zero-centred RMSNorms: 1 + w with w ~ N(0, 0.2)
        return (scale * torch.randn(shape, generator=g)).to(dtype)

    mtp = {
        f"mtp.layers.0.{name.removeprefix(layer_prefix)}": rand(tuple(t.shape), name.endswith("norm.weight"))
        for name, t in tensors.items()
        if name.startswith(layer_prefix)
    }
    mtp["mtp.fc.weight"] = rand((hidden, 2 * hidden), False)
    for name in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        mtp[f"mtp.{name}.weight"] = rand((hidden,), True)
    save_file({**tensors, **mtp}, str(f), metadata={"format": "pt"})
    return ckpt


def _text_config(ckpt: Path) -> dict[str, Any]:
    raw = json.loads((ckpt / "config.json").read_text())
    return raw.get("text_config", raw)


class DenseMtpReference:
    """The MTP head over whole sequences with transformers' Qwen3.5 decoder layer (full attention,
    eager, causal mask) and plain-torch norms / fc: no paged cache, no batching."""

    def __init__(self, ckpt: Path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        text = (
            self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        )
        text._attn_implementation = "eager"
        self.text_config = text
        tensors = {k: v.float() for k, v in load_file(str(ckpt / "model.safetensors")).items() if k.startswith("mtp.")}
        self.t = tensors
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        full = text.layer_types.index("full_attention")
        self.layer = m.Qwen3_5DecoderLayer(text, full).eval()
        state = {k.removeprefix("mtp.layers.0."): v for k, v in tensors.items() if k.startswith("mtp.layers.0.")}
        self.layer.load_state_dict(state)
        self.rotary = self._language_model().rotary_emb
        self.eps = text.rms_norm_eps

    def _language_model(self) -> Any:
        inner = self.model.model
        return getattr(inner, "language_model", inner)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.t[f"mtp.{name}.weight"])

    @torch.no_grad()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """[L, H]: the target's last hidden states (after its final norm)."""
        return self._language_model()(input_ids=torch.tensor([tokens])).last_hidden_state[0]

    @torch.no_grad()
    def heads(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Rows at positions 0..T-1 (causal): [T, H] embeds of the next tokens, [T, H] hidden -> MTP
        outputs [T, H] after mtp.norm."""
        x = torch.cat([self._norm(embeds, "pre_fc_norm_embedding"), self._norm(hidden, "pre_fc_norm_hidden")], -1)
        x = F.linear(x, self.t["mtp.fc.weight"])[None]  # [1, T, H]
        num = x.shape[1]
        positions = torch.arange(num)[None]
        cos_sin = self.rotary(x, positions)
        mask = torch.full((num, num), float("-inf")).triu(1)[None, None]
        out = self.layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return self._norm(out[0], "norm")

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The K greedy drafts after `tokens` (the context a step ended with): MTP rows 0..L-2 over
        the true sequence, then one row per draft, each fed the previous draft and MTP output."""
        embed = self._language_model().embed_tokens
        hidden = self.target_hidden(tokens)[:-1]  # rows 0..L-2
        embeds = embed(torch.tensor(tokens[1:]))
        out: list[int] = []
        for _ in range(k):
            h = self.heads(embeds, hidden)[-1]
            tok = int(self.model.lm_head(h).argmax())
            out.append(tok)
            embeds = torch.cat([embeds, embed(torch.tensor([tok]))])
            hidden = torch.cat([hidden, h[None]])
        return out


def make_predictable(ckpt: Path, dim: int = 0) -> Path:
    """Rewrite ckpt (untied lm_head, mtp.* present) so drafts get accepted often: the target's
    final norm keeps only hidden dimension `dim` (1 + w = 0 elsewhere) and lm_head scores only
    token 0 on it, so the target emits 0 where that component is positive and 1 (the first of the
    tied zero logits) elsewhere; mtp.norm zeroes the MTP output, so every draft is 0 (the first
    of its tied zero logits). Drafts are
    then accepted exactly when the target emits 0: full and partial acceptances and rejections."""
    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    prefix = _text_prefix(list(tensors))
    norm = torch.full_like(tensors[f"{prefix}norm.weight"], -1.0)
    norm[dim] = 0.0
    head = tensors["lm_head.weight"].clone()
    head[:, dim] = 0.0
    head[0] = 0.0
    head[0, dim] = 1.0
    tensors.update(
        {
            f"{prefix}norm.weight": norm,
            "lm_head.weight": head,
            "mtp.norm.weight": torch.full_like(tensors["mtp.norm.weight"], -1.0),
        }
    )
    save_file(tensors, str(f), metadata={"format": "pt"})
    return ckpt
