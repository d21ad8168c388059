"""Benchmark workloads: conversations of one or more turns (random, shared-prefix, multi-turn,
jsonl), with synthetic prompt lengths made token-exact through a `TokenCounter` (a local
tokenizer.json, the server's /tokenize, or a stated approximation)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
import tokenizers

DATASETS = ("random", "shared-prefix", "multi-turn", "jsonl")
DEFAULT_OUTPUT_LEN = 128
TURN_SEPARATOR = "\n\n"  # between system, turns and answers in a completions-endpoint prompt

# Common English words that are one token (with their leading space) in the GPT-2, Llama 3 and
# Qwen vocabularies: the approximate tokenizer counts one token per word.
COMMON_WORDS = tuple(
    sorted(
        set(
            """
the of and to in is was for that with on as by at from his her they this which have not are but
had were their one all been has more when who will would there can into its only other new some
time could these two may first then any like now my such our over man me even most made after
also did many before must through back years where much your way well down should because each
just those people how too little state good very make world still own see men work long get here
between both life being under never day same another know while last might us great old year off
come since against go came right used take three small large house water city light night point
""".split()
        )
    )
)


class TokenCounter(Protocol):
    """How many tokens a text is, by the target model's tokenizer (`exact`) or an estimate."""

    name: str
    exact: bool

    def count(self, text: str) -> int: ...

    def words(self) -> Sequence[str]:
        """Words that are (about) one token each, to build prompts from."""
        ...


class LocalTokenizer:
    """A `tokenizer.json` loaded with `tokenizers`: exact counts and token ids."""

    exact = True

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        # NOTE: the folder and file names only: a results file must not record a local path.
        self.name = f"local:{file.parent.name}/{file.name}"
        self._tok = tokenizers.Tokenizer.from_file(str(file))
        self._words: list[str] | None = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def words(self) -> Sequence[str]:
        if self._words is None:
            # Byte-level BPE marks a leading space with "Ġ", SentencePiece with "▁": such
            # single-token lowercase words give varied prompts that re-encode one token a word.
            vocab = sorted(self._tok.get_vocab().items(), key=lambda kv: kv[1])
            words = [
                t[1:]
                for t, _ in vocab
                if len(t) >= 4 and t[0] in "Ġ▁" and t[1:].isascii() and t[1:].isalpha() and t[1:].islower()
            ]
            self._words = words if len(words) >= 100 else list(COMMON_WORDS)
        return self._words


class RemoteTokenizer:
    """The server's own tokenizer through POST /tokenize (vLLM and SGLang shape)."""

    exact = True

    def __init__(self, url: str, model: str, api_key: str | None, client: httpx.Client) -> None:
        self.name = f"server:{url}"
        self._url, self._model, self._client = url, model, client
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    @classmethod
    def probe(cls, base_url: str, model: str, api_key: str | None) -> RemoteTokenizer | None:
        """The first /tokenize route of the server that answers with a count, else None."""
        root = base_url.rstrip("/").removesuffix("/v1")
        client = httpx.Client(timeout=10.0, trust_env=False)
        for url in (f"{root}/tokenize", f"{base_url.rstrip('/')}/tokenize"):
            tok = cls(url, model, api_key, client)
            try:
                if tok.count("hello world") > 0:
                    return tok
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue
        client.close()
        return None

    def count(self, text: str) -> int:
        body = {"model": self._model, "prompt": text, "add_special_tokens": False}
        resp = self._client.post(self._url, json=body, headers=self._headers)
        resp.raise_for_status()
        data = resp.json()
        return int(data["count"]) if "count" in data else len(data["tokens"])

    def words(self) -> Sequence[str]:
        return COMMON_WORDS


class ApproximateTokenizer:
    """No tokenizer at hand: one token per common word. Lengths are then estimates."""

    name = "approximate"
    exact = False

    def count(self, text: str) -> int:
        return len(text.split())

    def words(self) -> Sequence[str]:
        return COMMON_WORDS


def _served_root(base_url: str, model: str, api_key: str | None) -> str | None:
    """The checkpoint folder GET /models names for `model` (its `root`, as vLLM lists it), or
    None. fp4serve's `root` never holds a path (api/routes.py), so against it this finds a folder
    only when the name is one here; the server's /tokenize serves then."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=10.0, trust_env=False)
        entries = resp.json().get("data") or [] if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    roots = [e.get("root") for e in entries if isinstance(e, dict) and e.get("id") == model]
    return str(roots[0]) if roots and roots[0] else None


def load_tokenizer(path: str | None, base_url: str | None, model: str | None, api_key: str | None) -> TokenCounter:
    """`path` if given; else the served model's folder when it is on this machine (the model
    name, or the `root` GET /models lists); else the server's /tokenize; else the
    approximation (callers say so in their report)."""
    if path:
        return LocalTokenizer(path)
    for folder in (model, base_url and model and _served_root(base_url, model, api_key)):
        if folder and (Path(folder) / "tokenizer.json").is_file():
            return LocalTokenizer(folder)
    if base_url and model:
        remote = RemoteTokenizer.probe(base_url, model, api_key)
        if remote is not None:
            return remote
    return ApproximateTokenizer()


@dataclass(frozen=True)
class Turn:
    text: str  # the user message (chat) or its part of the prompt (completions)
    num_tokens: int  # tokens of `text` alone, by the dataset's TokenCounter
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    """A unit of work: one request, or turns sent one after another, each turn carrying the
    answers the server gave to the turns before it."""

    conversation_id: int
    turns: tuple[Turn, ...]
    system: str | None = None  # the shared prefix of the shared-prefix dataset
    system_tokens: int = 0
    group: int | None = None  # which shared prefix

    def __post_init__(self) -> None:
        assert self.turns, "a conversation needs at least one turn"

    def messages(self, turn: int, answers: Sequence[str]) -> list[dict[str, str]]:
        """Chat messages of turn `turn` given the answers to turns 0..turn-1."""
        assert len(answers) >= turn, f"turn {turn} needs {turn} answers, got {len(answers)}"
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for i in range(turn):
            msgs.append({"role": "user", "content": self.turns[i].text})
            msgs.append({"role": "assistant", "content": answers[i]})
        msgs.append({"role": "user", "content": self.turns[turn].text})
        return msgs

    def prompt(self, turn: int, answers: Sequence[str]) -> str:
        """The same conversation as one plain-text prompt, for the completions endpoint."""
        return TURN_SEPARATOR.join(m["content"] for m in self.messages(turn, answers))


@dataclass(frozen=True)
class DatasetSpec:
    """Which workload to build. Lengths are tokens; `range_ratio` r draws each length uniformly
    from [L(1-r), L(1+r)] as vLLM's random dataset does."""

    name: str
    num_requests: int
    input_len: int = 1024
    output_len: int | None = None  # None: DEFAULT_OUTPUT_LEN, or a jsonl answer's own length
    range_ratio: float = 0.0
    prefix_len: int = 512
    num_groups: int = 4
    num_turns: int = 4
    path: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose from {', '.join(DATASETS)}")
        if self.num_requests < 1 or self.input_len < 1 or (self.output_len or 1) < 1:
            raise ValueError("num_requests, input_len and output_len must be at least 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.prefix_len < 1 or self.num_groups < 1 or self.num_turns < 1:
            raise ValueError("prefix_len, num_groups and num_turns must be at least 1")
        if self.name == "jsonl" and not self.path:
            raise ValueError("the jsonl dataset needs --dataset-path")


class _TextMaker:
    """Random prompts of an exact token count: draw one-token words, count, trim or extend."""

    def __init__(self, tokenizer: TokenCounter, rng: random.Random) -> None:
        self._tok, self._rng, self._pool = tokenizer, rng, tokenizer.words()

    def make(self, num_tokens: int) -> tuple[str, int]:
        """A text of `num_tokens` tokens, or (rarely, when words are several tokens each and
        no combination lands exactly) the closest found, with its true count."""
        draw = self._rng.choice
        words = [draw(self._pool) for _ in range(num_tokens)]
        best: tuple[int, str, int] | None = None
        for _ in range(64):
            text = " ".join(words)
            n = self._tok.count(text)
            if n == num_tokens:
                return text, n
            if best is None or abs(n - num_tokens) < best[0]:
                best = (abs(n - num_tokens), text, n)
            # Step by whole words of the average size seen, at least one; single-word steps
            # that overshoot both ways are broken by swapping in another random word.
            per_word = n / len(words)
            step = max(1, int(abs(n - num_tokens) / per_word))
            if n < num_tokens:
                words.extend(draw(self._pool) for _ in range(step))
            elif len(words) > step:
                del words[len(words) - step :]
            else:
                words = [draw(self._pool)]
            if step == 1 and len(words) > 1 and self._rng.random() < 0.5:
                words[-1] = draw(self._pool)
        assert best is not None
        return best[1], best[2]


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    return rng.randint(max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio))))


def read_records(path: str | Path) -> list[tuple[str | None, str, str | None, int | None]]:
    """(system, prompt, reference answer, max_tokens) of each usable record of a JSONL file (or
    a JSON array, as ShareGPT ships): `{"conversations"|"messages": [{"from"|"role",
    "value"|"content"}]}` uses the first user turn and the answer after it; `{"prompt",
    "max_tokens"}` is taken as is. Records without a user prompt are skipped."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        items = json.loads(text)
    else:
        items = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
    out: list[tuple[str | None, str, str | None, int | None]] = []
    for obj in items:
        if not isinstance(obj, dict):
            continue
        if isinstance(obj.get("prompt"), str):
            max_tokens = obj.get("max_tokens", obj.get("output_len"))
            if obj["prompt"]:
                out.append((None, obj["prompt"], None, int(max_tokens) if max_tokens else None))
            continue
        turns = obj.get("conversations", obj.get("messages"))
        if not isinstance(turns, list):
            continue
        system = prompt = answer = None
        for t in turns:
            role = str(t.get("from", t.get("role", ""))).lower()
            content = t.get("value", t.get("content"))
            if not isinstance(content, str):
                continue
            if role == "system" and prompt is None:
                system = content
            elif role in ("human", "user") and prompt is None:
                prompt = content
            elif role in ("gpt", "assistant", "chatgpt", "bard", "model") and prompt is not None:
                answer = content
                break
        if prompt:
            out.append((system or None, prompt, answer, None))
    return out


def build_dataset(spec: DatasetSpec, tokenizer: TokenCounter) -> list[Conversation]:
    """The conversations of `spec`, reproducible from `spec.seed`."""
    rng = random.Random(spec.seed)
    maker = _TextMaker(tokenizer, rng)
    out_len = spec.output_len or DEFAULT_OUTPUT_LEN

    def turn() -> Turn:
        text, n = maker.make(_lengths(rng, spec.input_len, spec.range_ratio))
        return Turn(text, n, _lengths(rng, out_len, spec.range_ratio))

    if spec.name == "random":
        return [Conversation(i, (turn(),)) for i in range(spec.num_requests)]
    if spec.name == "shared-prefix":
        prefixes = [maker.make(spec.prefix_len) for _ in range(spec.num_groups)]
        groups = [i % spec.num_groups for i in range(spec.num_requests)]
        rng.shuffle(groups)
        return [Conversation(i, (turn(),), prefixes[g][0], prefixes[g][1], g) for i, g in enumerate(groups)]
    if spec.name == "multi-turn":
        num_convs = math.ceil(spec.num_requests / spec.num_turns)
        return [Conversation(i, tuple(turn() for _ in range(spec.num_turns))) for i in range(num_convs)]
    records = read_records(spec.path or "")
    rng.shuffle(records)
    convs = []
    for i, (system, prompt, answer, max_tokens) in enumerate(records[: spec.num_requests]):
        if spec.output_len is None and max_tokens is None and answer:
            max_tokens = max(1, tokenizer.count(answer))
        tokens = spec.output_len or max_tokens or DEFAULT_OUTPUT_LEN
        convs.append(
            Conversation(
                i, (Turn(prompt, tokenizer.count(prompt), tokens),), system, tokenizer.count(system) if system else 0
            )
        )
    return convs
