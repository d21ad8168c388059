"""The questions of the local lm-eval task `fp4serve_easy` (bench/lm_eval_tasks/): easy
four-way multiple choice, so that even SmolLM2-135M scores far above chance (25 %) and a server
whose loglikelihoods were wrong would be caught landing near it (llama.cpp issue 27174).

Two kinds, written here and drawn with a fixed seed, so the file is reproducible:
- the next item of a well-known sequence (days, months, number words, numerals, letters,
  ordinals), three other items of the same sequence as the wrong choices;
- short general-knowledge questions, with their wrong choices written by hand.

`python -m bench.lm_eval_questions` rewrites bench/lm_eval_tasks/easy_mc.jsonl."""

from __future__ import annotations

import random
import string
from pathlib import Path

import orjson

QUESTIONS_PATH = Path(__file__).parent / "lm_eval_tasks" / "easy_mc.jsonl"
SEED = 16
NUM_SEQUENCE_QUESTIONS = 60
SHOWN = 3  # items shown before the one to pick

SEQUENCES = {
    "days": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "months": [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ],
    "number words": ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"],
    "numerals": [str(i) for i in range(1, 31)],
    "letters": list(string.ascii_uppercase),
    "ordinals": ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"],
}

# (question, right answer, three wrong answers)
FACTS = [
    ("What is the capital of France?", "Paris", ["Tokyo", "Cairo", "Lima"]),
    ("What is the capital of Japan?", "Tokyo", ["Paris", "Madrid", "Nairobi"]),
    ("What is the capital of Italy?", "Rome", ["Oslo", "Tokyo", "Ottawa"]),
    ("What is the capital of Germany?", "Berlin", ["Lima", "Canberra", "Tokyo"]),
    ("What is the capital of Spain?", "Madrid", ["Beijing", "Ottawa", "Nairobi"]),
    ("What is the capital of England?", "London", ["Lima", "Seoul", "Cairo"]),
    ("What is the capital of Russia?", "Moscow", ["Dublin", "Lima", "Canberra"]),
    ("What is the capital of China?", "Beijing", ["Oslo", "Dublin", "Madrid"]),
    ("What is the capital of Egypt?", "Cairo", ["Berlin", "Oslo", "Ottawa"]),
    ("What is the capital of the United States?", "Washington", ["Paris", "Moscow", "Cairo"]),
    ("What color is the sky on a clear day?", "blue", ["green", "black", "purple"]),
    ("What color is grass?", "green", ["blue", "red", "white"]),
    ("What color is snow?", "white", ["black", "green", "orange"]),
    ("What color is a ripe banana?", "yellow", ["blue", "black", "purple"]),
    ("How many days are there in a week?", "seven", ["three", "twelve", "twenty"]),
    ("How many legs does a dog have?", "four", ["two", "ten", "eight"]),
    ("How many legs does a spider have?", "eight", ["two", "four", "three"]),
    ("How many months are there in a year?", "twelve", ["three", "seven", "forty"]),
    ("What is the opposite of hot?", "cold", ["warm", "red", "tall"]),
    ("What is the opposite of up?", "down", ["left", "blue", "fast"]),
    ("What is the opposite of big?", "small", ["large", "green", "loud"]),
    ("What is the opposite of day?", "night", ["sun", "week", "morning"]),
    ("What is the opposite of yes?", "no", ["maybe", "green", "always"]),
    ("What is the opposite of black?", "white", ["dark", "table", "night"]),
    ("What is the opposite of open?", "closed", ["door", "wide", "blue"]),
    ("What animal says meow?", "cat", ["cow", "fish", "snake"]),
    ("What animal says woof?", "dog", ["cat", "fish", "horse"]),
    ("What animal says moo?", "cow", ["dog", "cat", "bird"]),
    ("Which animal is known as the king of the jungle?", "lion", ["mouse", "rabbit", "snail"]),
    ("What do bees make?", "honey", ["milk", "steel", "paper"]),
    ("What do we breathe to stay alive?", "air", ["sand", "glass", "oil"]),
    ("What is frozen water called?", "ice", ["steam", "sand", "wood"]),
    ("What do you use to see?", "eyes", ["ears", "feet", "knees"]),
    ("What do you use to hear?", "ears", ["eyes", "hands", "teeth"]),
    ("Which planet do we live on?", "Earth", ["Mars", "Jupiter", "Pluto"]),
    ("What is the star at the center of our solar system?", "the Sun", ["the Moon", "Mars", "a comet"]),
    ("What is two plus two?", "four", ["seven", "ten", "one"]),
    ("What is the largest ocean on Earth?", "the Pacific Ocean", ["a small lake", "a river", "a pond"]),
    ("What language is spoken in France?", "French", ["Japanese", "Swahili", "Korean"]),
    ("What falls from clouds when it rains?", "water", ["sand", "stones", "paper"]),
]


def sequence_questions(rng: random.Random, count: int) -> list[dict]:
    """`count` distinct (sequence, start) questions."""
    starts = [(name, start) for name in sorted(SEQUENCES) for start in range(len(SEQUENCES[name]) - SHOWN)]
    questions = []
    for name, start in rng.sample(starts, count):
        items = SEQUENCES[name]
        shown, answer = items[start : start + SHOWN], items[start + SHOWN]
        wrong = rng.sample([item for item in items if item != answer and item not in shown], 3)
        questions.append(
            {
                "question": "Continue the list: " + ", ".join(shown) + ",",
                "answer": answer,
                "wrong": wrong,
                "kind": "sequence",
            }
        )
    return questions


def build_questions(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    drafts = sequence_questions(rng, NUM_SEQUENCE_QUESTIONS)
    drafts += [{"question": f"Question: {q}\nAnswer:", "answer": a, "wrong": w, "kind": "fact"} for q, a, w in FACTS]
    questions = []
    for i, draft in enumerate(drafts):
        choices = [draft["answer"], *draft["wrong"]]
        rng.shuffle(choices)
        questions.append(
            {
                "id": i,
                "kind": draft["kind"],
                "question": draft["question"],
                "choices": choices,
                "gold": choices.index(draft["answer"]),
            }
        )
    return questions


def write_questions(path: Path = QUESTIONS_PATH) -> int:
    questions = build_questions()
    path.write_bytes(b"".join(orjson.dumps(q) + b"\n" for q in questions))
    return len(questions)


if __name__ == "__main__":
    print(f"wrote {write_questions()} questions to {QUESTIONS_PATH}")
