"""bench/datasets.py: token-exact synthetic prompts, shared prefixes, multi-turn messages and the
two jsonl shapes, with a small byte-level BPE tokenizer trained in the fixture."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bench.datasets import (
    COMMON_WORDS,
    ApproximateTokenizer,
    Conversation,
    DatasetSpec,
    LocalTokenizer,
    Turn,
    build_dataset,
    load_tokenizer,
    read_records,
)


def train_tokenizer(path: Path, vocab_size: int) -> Path:
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(COMMON_WORDS) for _ in range(50)) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        ),
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenizer:
    return LocalTokenizer(train_tokenizer(tmp_path_factory.mktemp("tok"), 600))


def spec(name: str = "random", **kw: object) -> DatasetSpec:
    fields: dict[str, object] = {"num_requests": 12, "input_len": 32, "seed": 3} | kw
    return DatasetSpec(name, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("input_len", [1, 2, 7, 64, 333, 1024])
def test_random_prompts_have_exactly_input_len_tokens(tokenizer: LocalTokenizer, input_len: int) -> None:
    convs = build_dataset(spec(input_len=input_len, output_len=9), tokenizer)
    assert len(convs) == 12
    for conv in convs:
        (turn,) = conv.turns
        assert len(tokenizer.encode(turn.text)) == input_len == turn.num_tokens
        assert turn.max_tokens == 9
        assert conv.system is None


def test_range_ratio_draws_lengths_within_bounds(tokenizer: LocalTokenizer) -> None:
    convs = build_dataset(spec(num_requests=40, input_len=100, output_len=50, range_ratio=0.5), tokenizer)
    ins = [c.turns[0].num_tokens for c in convs]
    outs = [c.turns[0].max_tokens for c in convs]
    assert all(50 <= n <= 150 for n in ins) and len(set(ins)) > 10
    assert all(25 <= n <= 75 for n in outs) and len(set(outs)) > 10
    assert all(tokenizer.count(c.turns[0].text) == c.turns[0].num_tokens for c in convs)


def test_same_seed_same_prompts_other_seed_others(tokenizer: LocalTokenizer) -> None:
    a = build_dataset(spec(seed=1), tokenizer)
    assert a == build_dataset(spec(seed=1), tokenizer)
    b = build_dataset(spec(seed=2), tokenizer)
    assert all(x.turns[0].text != y.turns[0].text for x, y in zip(a, b))
    # No two prompts of a run start alike: nothing is served from the prefix cache by chance.
    assert len({tuple(tokenizer.encode(c.turns[0].text)[:4]) for c in a}) == len(a)


@pytest.mark.parametrize(("num_requests", "num_groups"), [(12, 3), (7, 4), (5, 1)])
def test_shared_prefix_groups_share_exactly_the_prefix(
    tokenizer: LocalTokenizer, num_requests: int, num_groups: int
) -> None:
    convs = build_dataset(
        spec("shared-prefix", num_requests=num_requests, input_len=16, prefix_len=48, num_groups=num_groups), tokenizer
    )
    assert len(convs) == num_requests
    by_group: dict[int, set[str]] = {}
    for conv in convs:
        assert conv.group is not None and conv.system is not None
        by_group.setdefault(conv.group, set()).add(conv.system)
        assert tokenizer.count(conv.system) == conv.system_tokens == 48
        assert conv.turns[0].num_tokens == 16
        # The completions prompt starts with exactly the prefix's tokens.
        prefix_ids = tokenizer.encode(conv.system)
        assert tokenizer.encode(conv.prompt(0, []))[:48] == prefix_ids
    assert sorted(by_group) == list(range(num_groups))
    assert all(len(systems) == 1 for systems in by_group.values())
    prefixes = [next(iter(s)) for s in by_group.values()]
    assert len({tuple(tokenizer.encode(p)[:2]) for p in prefixes}) == num_groups
    assert len({c.turns[0].text for c in convs}) == num_requests


def test_multi_turn_builds_enough_conversations_for_the_request_count(tokenizer: LocalTokenizer) -> None:
    convs = build_dataset(spec("multi-turn", num_requests=10, num_turns=3), tokenizer)
    assert len(convs) == math.ceil(10 / 3)
    assert all(len(c.turns) == 3 and all(t.num_tokens == 32 for t in c.turns) for c in convs)


def test_later_turns_carry_the_previous_answers() -> None:
    conv = Conversation(0, (Turn("q0", 1, 4), Turn("q1", 1, 4), Turn("q2", 1, 4)), "sys", 1)
    assert conv.messages(2, ["a0", "a1"]) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q0"},
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert conv.prompt(1, ["a0"]) == "sys\n\nq0\n\na0\n\nq1"


def write_jsonl(path: Path, items: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(i) for i in items) + "\n\n", encoding="utf-8")
    return path


SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "what is the time"},
        {"from": "gpt", "value": "the time is now"},
        {"from": "human", "value": "ignored"},
    ]
}
OPENAI_ROLES = {"messages": [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three"}]}
PROMPT_LINE = {"prompt": "hello there", "max_tokens": 7}


def test_jsonl_reads_sharegpt_role_and_prompt_shapes(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [SHAREGPT, OPENAI_ROLES, PROMPT_LINE, {"conversations": [{"from": "gpt", "value": "x"}]}, {"prompt": ""}],
    )
    assert read_records(path) == [
        ("be brief", "what is the time", "the time is now", None),
        (None, "one two", "three", None),
        (None, "hello there", None, 7),
    ]


def test_jsonl_also_reads_a_json_array(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([SHAREGPT, PROMPT_LINE]), encoding="utf-8")
    assert [r[1] for r in read_records(path)] == ["what is the time", "hello there"]


def test_jsonl_bad_line_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PROMPT_LINE) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_records(path)


def test_jsonl_output_lengths_come_from_line_answer_or_flag(tmp_path: Path, tokenizer: LocalTokenizer) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [SHAREGPT, PROMPT_LINE, {"prompt": "no length"}])
    convs = build_dataset(spec("jsonl", path=str(path), seed=0), tokenizer)
    by_prompt = {c.turns[0].text: c for c in convs}
    assert by_prompt["hello there"].turns[0].max_tokens == 7
    assert by_prompt["what is the time"].turns[0].max_tokens == tokenizer.count("the time is now")
    assert by_prompt["what is the time"].system == "be brief"
    assert by_prompt["no length"].turns[0].max_tokens == 128
    assert by_prompt["hello there"].turns[0].num_tokens == tokenizer.count("hello there")
    forced = build_dataset(spec("jsonl", path=str(path), output_len=5), tokenizer)
    assert [c.turns[0].max_tokens for c in forced] == [5, 5, 5]


def test_jsonl_takes_at_most_num_requests(tmp_path: Path, tokenizer: LocalTokenizer) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    assert len(build_dataset(spec("jsonl", path=str(path), num_requests=4), tokenizer)) == 4


@pytest.mark.parametrize(
    "kw", [{"name": "nope"}, {"range_ratio": 1.0}, {"input_len": 0}, {"name": "jsonl"}, {"num_groups": 0}]
)
def test_bad_dataset_spec_is_rejected(kw: dict[str, object]) -> None:
    name = str(kw.pop("name", "random"))
    with pytest.raises(ValueError):
        spec(name, **kw)


def test_multi_token_words_still_report_their_true_length(tmp_path: Path) -> None:
    # A tiny vocabulary: most words are several tokens, the pool falls back to common words.
    coarse = LocalTokenizer(train_tokenizer(tmp_path / "coarse", 300))
    for conv in build_dataset(spec(num_requests=8, input_len=50), coarse):
        assert conv.turns[0].num_tokens == coarse.count(conv.turns[0].text)
        assert abs(conv.turns[0].num_tokens - 50) <= 1


def test_load_tokenizer_prefers_path_then_model_folder_then_approximation(tmp_path: Path) -> None:
    folder = train_tokenizer(tmp_path / "model", 400)
    assert load_tokenizer(str(folder), None, None, None).exact
    assert load_tokenizer(None, None, str(folder), None).name.endswith("tokenizer.json")
    # Nothing listens on port 9: the /tokenize probe fails fast and we fall back.
    approx = load_tokenizer(None, "http://127.0.0.1:9/v1", "some-model", None)
    assert isinstance(approx, ApproximateTokenizer) and not approx.exact
    assert approx.count("one two  three\nfour") == 4
