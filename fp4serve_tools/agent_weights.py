"""The agent test model's weights, written down rather than trained: a 3-layer Qwen3 whose heads
and MLP neurons each do one job, so that it behaves exactly as fp4serve_tools/agent_model.py
documents, at any context length, in float32 and bfloat16 alike.

How it works (the residual stream is cut into named slices, see `Layout`):
- Every token has a random +-1 code of length 64 (its embedding, tied to the output layer) and a
  few flags (a newline in its text, `<tool_response>`, `<|im_end|>`).
- Layer 0: a head that looks one token back writes the previous token's code (P); two heads note
  whether a `<tool_response>` (RES) and an `<|im_end|>` (SYSEND: past the system turn) occurred so
  far; the MLP multiplies the current and previous codes elementwise (Q2: a code for the 2-gram,
  `silu(x) * y - silu(-x) * y = x * y`).
- Layer 1: a head copies the previous position's 2-gram code (K2); a head notes whether a
  `<tool_call>` occurred past the system turn (ASKED: the user wrote a call; the template's tools
  instructions hold one too, in the system turn); the MLP rewrites the 2-gram query at the few
  places where the output must jump: after `<tool_call>` (match the token after any `<tool_call>`), and at the
  first output position after a tool result (match the token after `<tool_response>\\n`).
- Layer 2: the copy head attends to the position whose preceding 2-gram equals the current one
  (past the system turn, the most recent first) and writes that position's token code, which the
  output layer reads as the next token; a head that looks at the current position cancels the
  current token's own code; the MLP starts a call (`<tool_call>`), ends an answer (`<|im_end|>`)
  at the first newline of a quoted tool result, or answers with `<|im_end|>` alone.

NOTE: attention sharpness lives in q_norm / k_norm weights: Qwen3 normalizes q and k per head,
so a head's raw q/k only give a direction, and the norm weights (shared by a layer's heads, so
each head uses its own RoPE pairs) give the scale."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.weights.qwen_tokenizer import QWEN3_VOCAB_SIZE

CODE = 64  # length of a token code
# RoPE pairs by use (rope_theta 1e15, head_dim 128: pair i turns theta_i = 10^(-0.234 i) a position).
POSITIONAL_PAIRS = range(12)  # theta 1 .. 0.003: sharp peaks at a fixed distance
RECENCY_PAIRS = range(3, 18)  # theta 0.2 .. 1e-4: summed, a score that falls with distance
CONTENT_PAIRS = range(28, 60)  # theta < 3e-7: no rotation within 65,536 positions
SYSTEM_TURN_PAIR = 60
FLAG_PAIRS = (61, 62)


@dataclass(frozen=True)
class Shape:
    """The checkpoint's config.json fields that the construction depends on."""

    hidden_size: int = 272
    num_layers: int = 3
    num_heads: int = 3
    head_dim: int = 128
    intermediate_size: int = 384
    # NOTE: huge on purpose: RoPE pairs 28 and up then turn by under 0.02 rad across 65,536
    # positions, so heads can match content there as if there were no rotation at all.
    rope_theta: float = 1e15
    max_position_embeddings: int = 65_536


@dataclass(frozen=True)
class Scales:
    """Attention and output magnitudes (logits units)."""

    positional: float = 25.0  # per RoPE pair of a head that attends to a fixed distance
    flag: float = 45.0  # score of a flagged token in a head that finds them (others: minus this)
    copy: float = 80.0  # score of an exact 2-gram match in the copy head
    recency: float = 1.0  # per RoPE pair of the copy head's preference for recent matches
    system_turn: float = 25.0  # penalty of the copy head on keys inside the system turn
    logit: float = 0.5  # output logits per unit of code overlap
    fixed: float = 4.0  # weight of a token the MLP writes over the copy
    gate: float = 60.0  # gain of the MLP's detector neurons


class Layout:
    """Slices of the residual stream."""

    T = slice(0, CODE)  # the current token's code (embedding; the output layer reads it)
    C = CODE  # constant 1 (embedding): the bias every projection reads from
    NL = CODE + 1  # flag: the token holds a newline, or ends a tool result or a turn
    TR = CODE + 2  # flag: `<tool_response>`
    IE = CODE + 3  # flag: `<|im_end|>`
    P = slice(CODE + 4, 2 * CODE + 4)  # the previous token's code
    ASKED = 2 * CODE + 4  # a `<tool_call>` occurred past the system turn: the user wrote a call
    RES = 2 * CODE + 5  # `<tool_response>` occurred
    SYSEND = 2 * CODE + 6  # `<|im_end|>` occurred (past the system turn)
    Q2 = slice(2 * CODE + 7, 3 * CODE + 7)  # 2-gram code of (current, previous): the copy query
    K2 = slice(3 * CODE + 7, 4 * CODE + 7)  # the previous position's Q2: the copy key
    Q1 = 4 * CODE + 7  # the query is the 1-gram `<tool_call>` instead
    STOP = 4 * CODE + 8  # the copied token holds a newline (its NL flag)


def build_weights(
    tokenizer: object, seed: int, shape: Shape = Shape(), scales: Scales = Scales()
) -> dict[str, torch.Tensor]:
    """HF Qwen3 tensors (float32) for `tokenizer` (a `tokenizers.Tokenizer` with Qwen3's vocabulary)."""
    return _Builder(tokenizer, seed, shape, scales).w


class _Builder:
    def __init__(self, tokenizer: object, seed: int, shape: Shape, scales: Scales) -> None:
        assert shape.num_layers == 3 and shape.hidden_size > Layout.STOP, shape
        self.tok, self.shape, self.sc = tokenizer, shape, scales
        generator = torch.Generator().manual_seed(seed)
        self.codes = (torch.randint(0, 2, (QWEN3_VOCAB_SIZE, CODE), generator=generator) * 2 - 1).float()  # [V, 64]
        self.perm = torch.randperm(CODE, generator=generator)  # the previous token's code is permuted: (a,b) != (b,a)
        hd = shape.head_dim
        self.pairs = hd // 2
        self.theta = 1.0 / (shape.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.w: dict[str, torch.Tensor] = {}
        self._zeros()
        self._embedding()
        self._layer0()
        self._layer1()
        self._layer2()
        self._norms()

    # ---- helpers ---------------------------------------------------------------------------------
    def tid(self, piece: str) -> int:
        token_id = self.tok.token_to_id(piece)
        assert token_id is not None, f"{piece!r} is not one token"
        return token_id

    def code(self, piece: str) -> torch.Tensor:
        return self.codes[self.tid(piece)]

    def q2(self, cur: str, prev: str) -> torch.Tensor:
        """The 2-gram code of `prev cur` (byte-level pieces, e.g. "Ċ" for a newline)."""
        return self.code(cur) * self.code(prev)[self.perm]

    def proj(self, layer: int, kind: str, head: int) -> torch.Tensor:
        """One head's rows of q/k/v_proj, [head_dim, hidden] (a view)."""
        hd = self.shape.head_dim
        return self.w[f"model.layers.{layer}.self_attn.{kind}_proj.weight"][head * hd : (head + 1) * hd]

    def o_cols(self, layer: int, head: int) -> torch.Tensor:
        hd = self.shape.head_dim
        return self.w[f"model.layers.{layer}.self_attn.o_proj.weight"][:, head * hd : (head + 1) * hd]

    def mlp(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self.w[f"model.layers.{layer}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))  # type: ignore[return-value]

    def _zeros(self) -> None:
        s, d, hd, nh, i = (
            self.shape,
            self.shape.hidden_size,
            self.shape.head_dim,
            self.shape.num_heads,
            self.shape.intermediate_size,
        )
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}"
            self.w[f"{p}.input_layernorm.weight"] = torch.zeros(d)
            self.w[f"{p}.post_attention_layernorm.weight"] = torch.zeros(d)
            for kind in ("q", "k", "v"):
                self.w[f"{p}.self_attn.{kind}_proj.weight"] = torch.zeros(nh * hd, d)
            self.w[f"{p}.self_attn.o_proj.weight"] = torch.zeros(d, nh * hd)
            self.w[f"{p}.self_attn.q_norm.weight"] = torch.ones(hd)
            self.w[f"{p}.self_attn.k_norm.weight"] = torch.ones(hd)
            self.w[f"{p}.mlp.gate_proj.weight"] = torch.zeros(i, d)
            self.w[f"{p}.mlp.up_proj.weight"] = torch.zeros(i, d)
            self.w[f"{p}.mlp.down_proj.weight"] = torch.zeros(d, i)

    # ---- parts ---------------------------------------------------------------------------------------
    def _embedding(self) -> None:
        emb = torch.zeros(QWEN3_VOCAB_SIZE, self.shape.hidden_size)  # [V, hidden]
        emb[:, Layout.T] = self.codes
        emb[:, Layout.C] = 1.0
        for token_id in range(self.tok.get_vocab_size()):
            piece = self.tok.id_to_token(token_id)
            # Byte-level pieces: "Ċ" is "\n" and "č" is "\r".
            if piece is not None and ("Ċ" in piece or "č" in piece):
                emb[token_id, Layout.NL] = 1.0
        for piece in ("</tool_response>", "<|im_end|>", "<|endoftext|>"):
            emb[self.tid(piece), Layout.NL] = 1.0
        emb[self.tid("<tool_response>"), Layout.TR] = 1.0
        emb[self.tid("<|im_end|>"), Layout.IE] = 1.0
        self.w["model.embed_tokens.weight"] = emb

    def positional_head(self, layer: int, head: int, distance: int, num_pairs: int = 12) -> None:
        """q and k from the constant, on RoPE pairs 0..num_pairs-1: the score is
        sum_i cos(theta_i (delta - distance)), highest at delta == distance."""
        q, k = self.proj(layer, "q", head), self.proj(layer, "k", head)
        for i in range(num_pairs):
            q[i, Layout.C] = math.cos(self.theta[i] * distance)
            q[i + self.pairs, Layout.C] = -math.sin(self.theta[i] * distance)
            k[i, Layout.C] = 1.0

    def flag_head(
        self,
        layer: int,
        head: int,
        pair: int,
        key: list[tuple[int | slice, torch.Tensor | float]],
        value: list[tuple[int | slice, torch.Tensor | float]],
        out: int,
    ) -> None:
        """q constant on one content pair; k = +-1 from `key` (a linear test of the residual);
        the head attends to the tokens that pass, writes `value` of them into `out`."""
        q, k, v = self.proj(layer, "q", head), self.proj(layer, "k", head), self.proj(layer, "v", head)
        q[pair, Layout.C] = 1.0
        for dims, weight in key:
            k[pair, dims] = weight
        for dims, weight in value:
            v[0, dims] = weight
        self.o_cols(layer, head)[out, 0] = 1.0

    def _layer0(self) -> None:
        self.positional_head(0, 0, distance=1)
        self.proj(0, "v", 0)[:CODE, Layout.T] = torch.eye(CODE)
        self.o_cols(0, 0)[Layout.P, :CODE] = torch.eye(CODE)
        self.flag_head(0, 1, FLAG_PAIRS[0], [(Layout.IE, 2.0), (Layout.C, -1.0)], [(Layout.IE, 1.0)], Layout.SYSEND)
        self.flag_head(0, 2, FLAG_PAIRS[1], [(Layout.TR, 2.0), (Layout.C, -1.0)], [(Layout.TR, 1.0)], Layout.RES)
        gate, up, down = self.mlp(0)
        for i in range(CODE):  # Q2[i] = T[i] * P[perm[i]], from two neurons
            prev = Layout.P.start + int(self.perm[i])
            for n, sign in ((2 * i, 1.0), (2 * i + 1, -1.0)):
                gate[n, Layout.T.start + i] = sign
                up[n, prev] = sign
                down[Layout.Q2.start + i, n] = 1.0

    def _detector(
        self,
        gate: torch.Tensor,
        row: int,
        terms: list[tuple[int | slice, torch.Tensor | float]],
        threshold: float,
        on: float,
    ) -> float:
        """Neuron `row` fires when the sum of its terms (each a dot product with the stream, 1 for a
        match) passes `threshold`; `on` is that sum when it should fire. Returns its gate's value
        then (silu(x) ~ x there), what a down projection divides by to write exactly 1."""
        for dims, weight in terms:
            gate[row, dims] = torch.as_tensor(weight) * self.sc.gate
        gate[row, Layout.C] = -threshold * self.sc.gate
        return (on - threshold) * self.sc.gate

    def _layer1(self) -> None:
        self.positional_head(1, 0, distance=1)
        self.proj(1, "v", 0)[:CODE, Layout.Q2] = torch.eye(CODE)
        self.o_cols(1, 0)[Layout.K2, :CODE] = torch.eye(CODE)
        # A `<tool_call>` past the system turn: the user wrote a call (the template's own tools
        # instructions, in the system turn, hold one too). NOTE: the value is 0 for a call inside the
        # system turn, since with no call past it the head attends to those (the best scores left).
        call = self.code("<tool_call>") / CODE
        self.flag_head(
            1,
            1,
            FLAG_PAIRS[0],
            [(Layout.T, call), (Layout.SYSEND, 1.0), (Layout.C, -1.5)],
            [(Layout.T, call), (Layout.SYSEND, 1.0), (Layout.C, -1.0)],
            Layout.ASKED,
        )
        gate, up, down = self.mlp(1)
        n = 0
        # After `<tool_call>`: a 1-gram query (whatever came before it), the 2-gram query dropped.
        on_call = [(Layout.T, self.code("<tool_call>") / CODE)]
        full = self._detector(gate, n, on_call, 0.7, 1.0)
        up[n, Layout.C] = 1.0
        down[Layout.Q1, n] = 1.0 / full
        n += 1
        for i in range(CODE):
            self._detector(gate, n, on_call, 0.7, 1.0)
            up[n, Layout.Q2.start + i] = 1.0
            down[Layout.Q2.start + i, n] = -1.0 / full
            n += 1
        # First output position after a tool result: look for the token after "<tool_response>\n".
        target = self.q2("Ċ", "<tool_response>")
        for cur, prev in (("Ċ", "assistant"), ("ĊĊ", "</think>")):  # the prompt's end, thinking on / off
            full = self._detector(gate, n, [(Layout.Q2, self.q2(cur, prev) / CODE), (Layout.RES, 1.0)], 1.75, 2.0)
            up[n, Layout.C] = 1.0
            down[Layout.Q2, n] = (target - self.q2(cur, prev)) / full
            n += 1
        # Its next step after a thinking-off prompt: the previous token is "\n\n", the source's "\n".
        after_blank = [(Layout.P, self.code("ĊĊ") / CODE), (Layout.RES, 1.0)]
        newline = self.code("Ċ")[self.perm]
        for i in range(CODE):
            full = self._detector(gate, n, after_blank, 1.75, 2.0)
            up[n, Layout.T.start + i] = 1.0
            down[Layout.Q2.start + i, n] = float(newline[i]) / full
            n += 1
            self._detector(gate, n, after_blank, 1.75, 2.0)
            up[n, Layout.Q2.start + i] = 1.0
            down[Layout.Q2.start + i, n] = -1.0 / full
            n += 1
        assert n <= self.shape.intermediate_size, n

    def _layer2(self) -> None:
        pairs = self.pairs
        q, k, v = self.proj(2, "q", 0), self.proj(2, "k", 0), self.proj(2, "v", 0)
        for i in RECENCY_PAIRS:
            q[i, Layout.C] = k[i, Layout.C] = self.recency_raw()
        # Content on pairs that barely turn (both halves): the query is the 2-gram code Q2, or the
        # code of `<tool_call>` for the 1-gram step; each key holds its 2-gram code K2 plus the
        # previous token's code P (a query for one is noise for the other).
        self.content_dims = [*(p for p in CONTENT_PAIRS), *(pairs + p for p in CONTENT_PAIRS)]
        call = self.code("<tool_call>")
        for a, dim in enumerate(self.content_dims):
            q[dim, Layout.Q2.start + a] = 1.0
            q[dim, Layout.Q1] = float(call[a])
            k[dim, Layout.K2.start + a] = 1.0
            k[dim, Layout.P.start + a] = 1.0
        q[SYSTEM_TURN_PAIR, Layout.C] = 1.0  # keys in the system turn (tools, instructions) lose to later ones
        k[SYSTEM_TURN_PAIR, Layout.SYSEND] = 2.0
        k[SYSTEM_TURN_PAIR, Layout.C] = -1.0
        v[:CODE, Layout.T] = torch.eye(CODE)
        v[CODE, Layout.NL] = 1.0
        o = self.o_cols(2, 0)
        o[Layout.T, :CODE] = torch.eye(CODE)
        o[Layout.STOP, CODE] = 1.0
        self.positional_head(2, 1, distance=0)  # the current token, to cancel its own code
        self.proj(2, "v", 1)[:CODE, Layout.T] = torch.eye(CODE)
        self.o_cols(2, 1)[Layout.T, :CODE] = -torch.eye(CODE)
        gate, up, down = self.mlp(2)
        n = 0
        fixed = self.sc.fixed
        for cur, prev in (("Ċ", "assistant"), ("ĊĊ", "</think>")):
            start = (Layout.Q2, self.q2(cur, prev) / CODE)
            full = self._detector(gate, n, [start, (Layout.ASKED, 1.0), (Layout.RES, -1.0)], 1.75, 2.0)
            up[n, Layout.C] = 1.0
            down[Layout.T, n] = fixed * self.code("<tool_call>") / full
            n += 1
            full = self._detector(gate, n, [start, (Layout.ASKED, -1.0), (Layout.RES, -1.0)], 0.75, 1.0)
            up[n, Layout.C] = 1.0
            down[Layout.T, n] = fixed * self.code("<|im_end|>") / full
            n += 1
        full = self._detector(gate, n, [(Layout.STOP, 1.0), (Layout.RES, 1.0)], 1.75, 2.0)
        up[n, Layout.C] = 1.0
        down[Layout.T, n] = fixed * self.code("<|im_end|>") / full

    def recency_raw(self) -> float:
        """The raw q/k entry of the copy head's recency pairs that gives `Scales.recency` per pair
        after q/k normalization (solved by iteration: the entry changes the normalization)."""
        a = 0.5
        for _ in range(60):
            sq, sk = self._copy_norms(a)
            a = math.sqrt(self.sc.recency * math.sqrt(self.shape.head_dim) / (sq * sk * self._positional_weight() ** 2))
        return a

    def _copy_norms(self, a: float) -> tuple[float, float]:
        """What RMS normalization multiplies the copy head's raw q and k by (k holds two codes)."""
        n, hd = len(RECENCY_PAIRS), self.shape.head_dim
        return math.sqrt(hd / (n * a * a + CODE + 1)), math.sqrt(hd / (n * a * a + 2 * CODE + 1))

    def _positional_weight(self) -> float:
        """q/k norm weight on positional pairs: a per-pair score of `Scales.positional`."""
        hd = self.shape.head_dim
        return math.sqrt(self.sc.positional * math.sqrt(hd) * 12 / hd)

    def _norms(self) -> None:
        hd, d = self.shape.head_dim, self.shape.hidden_size
        # Layer norms keep the stream's values: each weight is the RMS the stream has there.
        sums = {
            0: (65, 65 + CODE + 1),
            1: (65 + 2 * CODE + 2, 65 + 3 * CODE + 3),
            2: (65 + 3 * CODE + 3, 65 + 4 * CODE + 3),
        }
        for layer, (attn_in, mlp_in) in sums.items():
            self.w[f"model.layers.{layer}.input_layernorm.weight"][:] = math.sqrt(attn_in / d)
            self.w[f"model.layers.{layer}.post_attention_layernorm.weight"][:] = math.sqrt(mlp_in / d)
        wpos = self._positional_weight()
        wflag = math.sqrt(self.sc.flag / math.sqrt(hd))
        for layer in range(3):
            qn = self.w[f"model.layers.{layer}.self_attn.q_norm.weight"]
            kn = self.w[f"model.layers.{layer}.self_attn.k_norm.weight"]
            for i in POSITIONAL_PAIRS:
                qn[i] = kn[i] = qn[i + self.pairs] = kn[i + self.pairs] = wpos
            if layer < 2:
                for pair in FLAG_PAIRS:
                    qn[pair] = kn[pair] = wflag
        sq, sk = self._copy_norms(self.recency_raw())
        qn, kn = self.w["model.layers.2.self_attn.q_norm.weight"], self.w["model.layers.2.self_attn.k_norm.weight"]
        wcopy = math.sqrt(self.sc.copy * math.sqrt(hd) / (CODE * sq * sk))
        for dim in self.content_dims:
            qn[dim] = kn[dim] = wcopy
        for i in RECENCY_PAIRS:
            qn[i] = kn[i] = wpos
        qn[SYSTEM_TURN_PAIR] = kn[SYSTEM_TURN_PAIR] = math.sqrt(self.sc.system_turn * math.sqrt(hd) / (sq * sk))
        final = torch.zeros(d)
        final[Layout.T] = self.sc.logit * math.sqrt((65 + 4 * CODE + 3) / d)
        self.w["model.norm.weight"] = final
