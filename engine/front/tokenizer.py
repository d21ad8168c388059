"""The checkpoint's tokenizer: encode, decode, the chat template (through transformers), whether
that template shows the model a request's tools, and per-token text/bytes for logprobs.
Incremental decoding lives in engine/front/detokenizer.py."""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.errors import ConfigError
from scheduler.request import ParamError

logger = logging.getLogger("fp4serve.tokenizer")

# A tool no template can know: its name appears in a rendering only if the template writes tools.
_PROBE_TOOL_NAME = "fp4serve_probe_tool_6f1d"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_TOOL_NAME,
        "description": "A probe: does the chat template show tools to the model?",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}
_PROBE_MESSAGES = [{"role": "user", "content": "hello"}]


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet (printable stand-ins for the 256 bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# The weights' files: what a tokenizer never reads, so their changes never load it again.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def load_hf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of the checkpoint folder `path`, loaded once per process while its
    files stay as they are: a process that builds several engines on one checkpoint (data parallel
    in process, benchmarks, tests) would otherwise spend most of a second on each, in Python's JSON
    parser under the GIL. The object is shared: callers only read it."""
    folder = Path(path).resolve()
    try:
        signature = tuple(
            sorted(
                (entry.name, stat.st_size, stat.st_mtime_ns)
                for entry in folder.iterdir()
                if not entry.name.endswith(_WEIGHT_SUFFIXES) and entry.is_file() and (stat := entry.stat())
            )
        )
    except OSError:  # not a folder (transformers says what is wrong with it)
        signature = ()
    return _load_hf_tokenizer(str(folder), signature)


@lru_cache(maxsize=4)
def _load_hf_tokenizer(folder: str, signature: tuple[tuple[str, int, int], ...]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


class Tokenizer:
    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> None:
        try:
            self.hf: PreTrainedTokenizerBase = load_hf_tokenizer(path)
        except Exception as e:  # transformers raises many types here; one line is what a user needs
            raise ConfigError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
        backend = getattr(self.hf, "backend_tokenizer", None)
        if not isinstance(backend, tokenizers.Tokenizer):
            raise ConfigError(f"{path}: a fast tokenizer (tokenizer.json) is required")
        self.backend: tokenizers.Tokenizer = backend
        ids = list(eos_token_ids)
        if self.hf.eos_token_id is not None and self.hf.eos_token_id not in ids:
            ids.append(self.hf.eos_token_id)
        self.eos_token_ids = tuple(ids)
        self.chat_template: str | None = getattr(self.hf, "chat_template", None)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        # The decoder's own JSON (a Sequence of decoders names each), not the whole tokenizer's.
        decoder = self.backend.decoder
        self._byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
        self._added_ids = frozenset(self.backend.get_added_tokens_decoder())
        self._token_cache: dict[int, tuple[str, tuple[int, ...]]] = {}
        # Whether a request's tools reach the model: a template that ignores them (SmolLM2's) turns
        # a tool request into a plain chat, and the model never knows it could call anything.
        self.template_renders_tools = self._renders_tools()
        if self.chat_template and not self.template_renders_tools:
            logger.warning(
                "the chat template of %s does not render tools: a request's tools never reach the "
                "model, which answers them as plain chat; serve a checkpoint whose template writes "
                "tools (Qwen3, Qwen3-Coder, Llama 3.1+) for tool calling",
                path,
            )

    def _renders_tools(self) -> bool:
        """Render a probe conversation with a probe tool: True when the tool's name is in the prompt
        (and not without the tool). A template that fails on the probe counts as not rendering."""
        if not self.chat_template:
            return False
        try:
            with_tool = self.render_chat(_PROBE_MESSAGES, [_PROBE_TOOL])
            without = self.render_chat(_PROBE_MESSAGES, None)
        except ParamError:
            return False
        return _PROBE_TOOL_NAME in with_tool and _PROBE_TOOL_NAME not in without

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        if not self.chat_template:
            raise ParamError("this model has no chat template; use /v1/completions", "messages")
        try:
            return self.hf.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except jinja2.TemplateError as e:  # the template's own raise_exception() and jinja's errors: its words
            raise ParamError(f"the chat template failed on these messages: {e}", "messages") from None
        except Exception as e:  # NOTE: anything else is Python's own (a recursion, a type error): not for clients
            logger.warning("the chat template failed on a request's messages", exc_info=e)
            raise ParamError("the chat template failed on these messages (see the server log)", "messages") from None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        text = self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)
        # The template already wrote any BOS token.
        return self.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """The token's own text and UTF-8 bytes (OpenAI's logprobs `token` and `bytes`)."""
        cached = self._token_cache.get(token_id)
        if cached is not None:
            return cached
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            result = ("", ())
        elif self._byte_level and token_id not in self._added_ids:
            dec = _byte_decoder()
            raw = bytes(dec[c] for c in piece if c in dec)
            result = (raw.decode("utf-8", errors="replace"), tuple(raw))
        else:
            text = self.backend.decode([token_id], skip_special_tokens=False)
            result = (text, tuple(text.encode("utf-8")))
        if len(self._token_cache) < 1 << 18:
            self._token_cache[token_id] = result
        return result
