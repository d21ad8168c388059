"""Grammar-constrained decoding with xgrammar: compiles requests' `StructuredOutput` specs (off the
step thread, cached by spec within a byte budget, keys taking turns: engine/structured_output/grammar_cache.py), owns
one matcher per constrained request, builds the token bitmask of a step's constrained rows
(`GrammarMask`), and advances the matchers with the sampled tokens.

Which compiler each kind uses (measured by `python -m bench.structured_compile`, docs/PERF.md):
- regex and ebnf: xgrammar's own (`compile_regex`, `compile_grammar`): nothing of ours to add.
- structural_tag (vLLM's field): xgrammar's own builder, its grammar text compiled as an ebnf's
  (engine/grammars/structural_tag.py).
- json_object, json_schema and tool_calls: our rules (engine/grammars/), for three guarantees
  xgrammar 0.2.8's JSON-schema compiler and structural tags do not give. Compile times were the
  same within noise on the Qwen vocabulary, and so were masks except in a length-bounded string,
  where xgrammar's `{0,n}` repetition took up to ~75 ms a token and our chain of rules 0.1 ms:
  - the output ends: our numbers take at most 19 integer and 16 fraction digits; xgrammar's take
    `[0-9]*`, so a masked weak model can write digits until max_tokens;
  - a string's minLength/maxLength count an escape such as `\\n` as one character, as JSON
    Schema does; xgrammar's length-bounded strings allow no escapes at all;
  - a forced tool call is compact JSON with json.dumps' separators and nothing else around it
    but the template's newlines; structural tags (JSONSchemaFormat) take any whitespace between
    tokens or none (max_whitespace_cnt), never ", " and ": ", and "required" lets free text sit
    between the calls.
  A json_schema with what xgrammar's converter enforces and ours does not (pattern, format,
  numeric ranges) goes through xgrammar's converter, our bounds kept (engine/grammars/xgrammar_json.py).

A grammar's end allows only the request's stop tokens (EOS, stop_token_ids), so a request ends
with finish_reason "stop" exactly when its grammar is complete. A grammar that cannot be built or
compiled is never left out silently: its request ends with an error (`take_failed`), a log line and
fp4serve_grammar_failures_total by reason. The compiler's tokenizer tables are built at start-up,
off the engine's thread (engine/structured_output/compiler.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.core_types import GrammarCacheStats
from engine.structured_output.compiler import Compiler, GrammarFailed
from engine.structured_output.grammar_cache import (
    DEFAULT_COMPILE_WORKERS,
    DEFAULT_GRAMMAR_CACHE_BYTES,
    GrammarCache,
)
from scheduler.request import ParamError
from scheduler.structured_output import StructuredOutput

logger = logging.getLogger("fp4serve.structured")


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask: bit j of word w allows token 32 * w + j."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class GrammarMask:
    """Which tokens the constrained rows of one step may sample."""

    rows: tuple[int, ...]  # rows of the step's logits that are constrained, ascending
    bitmask: torch.Tensor  # [len(rows), bitmask_words(V)] int32, on the logits' device
    vocab_size: int

    def __post_init__(self) -> None:
        assert self.rows and self.bitmask.shape == (len(self.rows), bitmask_words(self.vocab_size)), (
            f"bitmask {tuple(self.bitmask.shape)} for rows {self.rows}, vocab {self.vocab_size}"
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] (not written) -> a float32 copy whose constrained rows hold -inf at every
        token the grammar does not allow. Unconstrained rows are copied, never touched."""
        from xgrammar import (
            apply_token_bitmask_inplace,  # a CPU kernel, or Triton/CUDA on GPU
        )

        out = logits.to(torch.float32, copy=True)  # [B, V] f32
        if len(self.rows) == out.shape[0]:
            apply_token_bitmask_inplace(out, self.bitmask, vocab_size=self.vocab_size)
            return out
        index = torch.tensor(self.rows, dtype=torch.int64, device=out.device)
        constrained = out[index]  # [R, V] f32, a gathered copy
        apply_token_bitmask_inplace(constrained, self.bitmask, vocab_size=self.vocab_size)
        out[index] = constrained
        return out


@dataclass(eq=False)
class _Constrained:
    """One request's grammar state (mutable; owned by StructuredOutputs, runner thread only)."""

    compiled: Future[Any]  # -> xgrammar.CompiledGrammar
    stop_token_ids: tuple[int, ...]
    matcher: Any = None  # xgrammar.GrammarMatcher, made when the request first samples
    failed: bool = False  # its grammar could not be made: the request ends with an error (take_failed)


class StructuredOutputs:
    """Grammar state for every constrained request of one engine (one tokenizer).

    Called from the engine's thread; compiles run on GrammarCache's pool.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
        compile_workers: int = DEFAULT_COMPILE_WORKERS,
    ) -> None:
        """`tokenizer`: the checkpoint's transformers tokenizer, or its folder (loaded on the first
        compile, or by `start`); `vocab_size`: the model's (padded) logits width, which may exceed
        the tokenizer's; `cache_bytes`: the budget of compiled grammars kept (--grammar-cache-bytes)."""
        assert vocab_size > 0, f"vocab_size {vocab_size}"
        self.vocab_size = vocab_size
        self.compiler = Compiler(tokenizer, vocab_size)
        # NOTE: a lambda, so that the compile step can be replaced on an instance (tests slow it down).
        self._cache = GrammarCache(lambda spec: self._compile_now(spec), cache_bytes, compile_workers)
        self._used = False  # whether any grammar was asked for: stats() is None until then
        self._held: dict[str, Future[Any]] = {}  # request id -> the grammar it holds, from prepare to remove
        self._requests: dict[str, _Constrained] = {}
        self._failed: dict[str, str] = {}  # request id -> why its grammar could not be made, until taken
        self._num_failed: dict[str, int] = {}  # cumulative, by reason: requests whose grammar could not be made
        self._failed_lock = threading.Lock()  # NOTE: mask() may run on the runner's thread, take_failed() on the loop's
        # [rows, words] int32, cpu (pinned for an async copy when the logits are on a GPU)
        self._host_bitmask = torch.empty(0, bitmask_words(vocab_size), dtype=torch.int32)

    # ---- requests ------------------------------------------------------------------------------
    @staticmethod
    def check(spec: StructuredOutput) -> None:
        """Raise ParamError unless an ebnf spec's grammar or a regex spec's pattern is valid (no
        tokenizer needed, about a millisecond): lets a caller refuse it before it is queued. The
        other kinds come from the api, which checked their schemas."""
        if spec.kind == "structural_tag":
            from engine.grammars.structural_tag import structural_tag_ebnf

            try:
                structural_tag_ebnf(spec.text)
            except ValueError as e:
                raise ParamError(str(e), "structural_tag") from None
            return
        if spec.kind not in ("ebnf", "regex"):
            return  # NOTE: no xgrammar import for them: it takes seconds, on the server's event loop
        import xgrammar

        try:
            if spec.kind == "ebnf":
                xgrammar.Grammar.from_ebnf(spec.text)
            elif spec.kind == "regex":
                xgrammar.Grammar.from_regex(spec.text)
        except RuntimeError as e:
            raise ParamError(
                f"invalid {'grammar' if spec.kind == 'ebnf' else 'regex'}: {str(e).splitlines()[-1][:300]}",
                "grammar" if spec.kind == "ebnf" else "regex",
            ) from None

    @staticmethod
    def prepare_checks() -> None:
        """Import xgrammar now (at start-up, off the event loop): `check` needs it, and importing it
        holds the GIL for seconds, which would stall every stream of the server's process."""
        import xgrammar  # noqa: F401

    def add_request(self, request_id: str, spec: StructuredOutput, stop_token_ids: Sequence[int]) -> None:
        """The request starts running with the grammar `prepare` started for it (or starts it now,
        on the `default` key's turn, when nothing was prepared)."""
        assert request_id not in self._requests, f"request {request_id!r} is already constrained"
        assert stop_token_ids, f"{request_id}: a grammar needs a stop token to end on"
        compiled = self._held.get(request_id) or self.prepare(spec, "default", request_id)
        self._requests[request_id] = _Constrained(compiled, tuple(dict.fromkeys(stop_token_ids)))

    def remove_request(self, request_id: str) -> None:
        """The request ended (or was aborted, maybe while its grammar still waited to compile): it
        lets go of its grammar."""
        self._requests.pop(request_id, None)  # its matcher first: it refers to the compiled grammar
        held = self._held.pop(request_id, None)
        if held is not None:
            self._cache.release(held)

    def start(self) -> None:
        """Build the compiler's tokenizer tables now, on a thread of their own (at start-up)."""
        self.compiler.start()

    def take_failed(self) -> dict[str, str]:
        """The requests whose grammar could not be built or compiled since the last call, with the
        reason: each must end with an error, not as if the model had stopped."""
        with self._failed_lock:
            failed, self._failed = self._failed, {}
        return failed

    def stats(self) -> GrammarCacheStats | None:
        """The compiled-grammar cache; None while no request has been constrained."""
        if not self._used:
            return None
        with self._failed_lock:
            failures = tuple(sorted(self._num_failed.items()))
        return replace(self._cache.stats(), failures=failures)

    def is_terminated(self, request_id: str) -> bool:
        """Whether the request's grammar is complete and a stop token was accepted after it (or
        its grammar did not compile): from here on only stop tokens are allowed."""
        state = self._requests.get(request_id)
        return state is not None and (state.failed or (state.matcher is not None and state.matcher.is_terminated()))

    # ---- a step -------------------------------------------------------------------------------
    def mask(self, request_ids: Sequence[str], device: torch.device) -> GrammarMask | None:
        """The bitmask for the constrained rows of a step that samples `request_ids` (row i for
        request_ids[i]), on the logits' `device`; None when no row is constrained. Blocks on a
        grammar still compiling."""
        if not self._requests:
            return None  # the common step: nothing constrained anywhere
        rows = tuple(i for i, r in enumerate(request_ids) if r in self._requests)
        if not rows:
            return None
        host = self._host_rows(len(rows), pin=device.type == "cuda")  # [R, words] int32, cpu
        for k, i in enumerate(rows):
            state = self._requests[request_ids[i]]
            matcher = self._matcher(request_ids[i], state)
            if matcher is None or matcher.is_terminated():
                # A finished grammar (or one that failed): only its stop tokens, so the request
                # ends even when min_tokens or ignore_eos kept it going past the first one.
                host[k] = self._stop_row(state.stop_token_ids)
            else:
                matcher.fill_next_token_bitmask(host, k)
        # NOTE: non_blocking reads the pinned buffer after this returns; the next step rewrites it
        # only after the sampler's read-back has synchronized the stream.
        bitmask = host if device.type == "cpu" else host.to(device, non_blocking=True)
        return GrammarMask(rows, bitmask, self.vocab_size)

    def accept(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        """Advance the constrained requests' matchers by the tokens this step sampled."""
        for request_id, token_id in zip(request_ids, token_ids, strict=True):
            state = self._requests.get(request_id)
            if state is None or state.matcher is None or state.matcher.is_terminated():
                continue
            if not state.matcher.accept_token(token_id):
                # Unreachable while the sampler honours the mask; the text would break the grammar.
                logger.error("%s: sampled token %d is not allowed by its grammar", request_id, token_id)

    # ---- internals ----------------------------------------------------------------------------
    def prepare(self, spec: StructuredOutput, key: str = "default", request_id: str | None = None) -> Future[Any]:
        """Start compiling `spec`'s grammar on `key`'s turn (or find it compiled); done() tells when it is
        ready. With `request_id`, the request holds the grammar (from here through `add_request`)
        until `remove_request`; a compile no request holds any more before it starts is dropped.

        Called when a request arrives, so the engine can keep the request out of the batch until
        then: a new grammar (up to seconds) never stalls other users' steps."""
        self._used = True
        future = self._cache.get(spec, key, hold=request_id is not None)
        if request_id is not None:
            assert request_id not in self._held, f"request {request_id!r} already holds a grammar"
            self._held[request_id] = future
        return future

    def _compile_now(self, spec: StructuredOutput) -> Any:
        """On a worker thread: the compiler (its tables built at start-up, or now) compiles (which
        compiler for which kind: the module docstring); GrammarFailed with its reason otherwise."""
        return self.compiler.compile(spec)

    def _matcher(self, request_id: str, state: _Constrained) -> Any:
        if state.matcher is None and not state.failed:
            import xgrammar

            try:
                compiled = state.compiled.result()
            except Exception as e:
                # NOTE: failing the step would fail every request in the batch; this request alone
                # ends, with an error (take_failed): never as if the model chose to say nothing.
                reason = e.reason if isinstance(e, GrammarFailed) else "compile"
                logger.error(
                    "%s: its grammar could not be made (%s); the request ends with an error",
                    request_id,
                    e,
                    exc_info=not isinstance(e, GrammarFailed),
                )
                state.failed = True
                with self._failed_lock:
                    self._failed[request_id] = reason
                    self._num_failed[reason] = self._num_failed.get(reason, 0) + 1
                return None
            state.matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(state.stop_token_ids))
        return state.matcher

    def _host_rows(self, num_rows: int, pin: bool) -> torch.Tensor:
        if self._host_bitmask.shape[0] < num_rows:
            size = max(num_rows, 2 * self._host_bitmask.shape[0], 8)
            self._host_bitmask = torch.empty(size, self._host_bitmask.shape[1], dtype=torch.int32, pin_memory=pin)
        return self._host_bitmask[:num_rows]

    def _stop_row(self, stop_token_ids: tuple[int, ...]) -> torch.Tensor:
        words = [0] * bitmask_words(self.vocab_size)
        for t in stop_token_ids:
            words[t // 32] |= 1 << (t % 32)
        # int32 holds bit 31 as the sign: the same 32 bits.
        return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
