"""Write jobs/data/sft_sample.jsonl: synthetic instruction-following rows with checkable answers.

Every row is ``{"id", "task", "prompt", "completion", "answer"}`` (the ``prompt_completion``
format plus three extra fields). ``answer`` is the canonical answer as a string; the
completion is either exactly ``answer`` (when the prompt asks for the answer only) or a short
worked explanation ending in ``"The answer is <answer>."`` (when the prompt asks for one), so a
later stage can check a model's output programmatically (reward pairs, RL rewards).

Deterministic: standard library only, one ``random.Random(0)``. Run from anywhere:

    python jobs/data/make_sft_sample.py [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random

SEED = 0
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft_sample.jsonl")

# Rows per task family (600 in all).
TASK_COUNTS = {
    "addition": 60,
    "subtraction": 50,
    "multiplication": 50,
    "reverse_word": 50,
    "count_letter": 50,
    "unit_conversion": 50,
    "uppercase": 40,
    "lowercase": 40,
    "sort_words": 50,
    "capital": 50,
    "word_count": 40,
    "multiples": 40,
    "max_number": 30,
}
EXPLAIN_FRACTION = 0.35

WORDS = """
apple river stone cloud garden window silver orange planet forest candle bridge market
yellow pencil winter summer rabbit turtle mirror ladder basket castle dragon engine
feather guitar harbor island jacket kettle lemon meadow needle ocean pepper quiet rocket
saddle tiger umbrella valley wagon zebra anchor button cactus desert eagle falcon glacier
hammer igloo jungle kitten lantern magnet nectar orchard parrot quilt raven sailor tunnel
velvet walnut yogurt blanket chimney dolphin echo fountain goblet helmet iris jasmine
koala lobster mango nickel oyster pillow quartz ribbon spider tomato unicorn violin whistle
banana cherry grape melon peach plum berry carrot onion potato garlic ginger butter cheese
bread honey sugar coffee tea water milk juice salt
""".split()

SMALL_WORDS = """the a of and to in is on it that with as was for at by from this be are
old new big small red blue green quick slow happy calm bright dark warm cold soft loud""".split()

# Country -> capital, written for this sample (well-known, unambiguous capitals).
CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Brazil": "Brasilia",
    "Argentina": "Buenos Aires",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Poland": "Warsaw",
    "Austria": "Vienna",
    "Greece": "Athens",
    "Ireland": "Dublin",
    "Hungary": "Budapest",
    "Czechia": "Prague",
    "Russia": "Moscow",
    "Turkey": "Ankara",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "South Korea": "Seoul",
    "Indonesia": "Jakarta",
    "Australia": "Canberra",
    "New Zealand": "Wellington",
    "Nigeria": "Abuja",
    "Morocco": "Rabat",
    "Cuba": "Havana",
    "Colombia": "Bogota",
    "Iceland": "Reykjavik",
    "Belgium": "Brussels",
}

# (from unit, its singular, to unit, factor, allow one decimal place)
UNITS = [
    ("kilometers", "kilometer", "meters", 1000, True),
    ("meters", "meter", "centimeters", 100, True),
    ("kilograms", "kilogram", "grams", 1000, True),
    ("liters", "liter", "milliliters", 1000, True),
    ("hours", "hour", "minutes", 60, False),
    ("minutes", "minute", "seconds", 60, False),
    ("days", "day", "hours", 24, False),
    ("feet", "foot", "inches", 12, False),
    ("weeks", "week", "days", 7, False),
]


def tail_int(rng: random.Random, lo: int, hi: int, alpha: float = 1.6) -> int:
    """A long-tailed integer in [lo, hi]: mostly near lo, occasionally large."""
    return min(hi, lo + int(rng.paretovariate(alpha)) - 1)


def join_and(items: list[str]) -> str:
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def finish(prompt_short, prompt_explain, answer, explanation, explain):
    """(prompt, completion, answer) for the short or the explained variant."""
    if explain:
        return prompt_explain, f"{explanation} The answer is {answer}.", answer
    return prompt_short, answer, answer


def make_addition(rng, explain):
    a, b = rng.randint(2, 10 ** rng.randint(2, 4)), rng.randint(2, 10 ** rng.randint(2, 4))
    ans = str(a + b)
    q = f"What is {a} + {b}?"
    return finish(
        f"{q} Answer with the number only.",
        f"{q} Show the sum, then give the answer.",
        ans,
        f"{a} + {b} = {a + b}.",
        explain,
    )


def make_subtraction(rng, explain):
    a, b = rng.randint(10, 10 ** rng.randint(2, 4)), rng.randint(1, 999)
    ans = str(a - b)
    q = f"What is {a} - {b}?"
    return finish(
        f"{q} Answer with the number only.",
        f"{q} Show the difference, then give the answer.",
        ans,
        f"{a} - {b} = {a - b}.",
        explain,
    )


def make_multiplication(rng, explain):
    a, b = rng.randint(2, 99), rng.randint(2, 10 ** rng.randint(1, 2))
    ans = str(a * b)
    q = f"What is {a} times {b}?"
    return finish(
        f"{q} Answer with the number only.",
        f"{q} Show the product, then give the answer.",
        ans,
        f"{a} x {b} = {a * b}.",
        explain,
    )


def make_reverse_word(rng, explain):
    w = rng.choice(WORDS)
    ans = w[::-1]
    return finish(
        f"Reverse the letters of the word '{w}'. Answer with the reversed word only.",
        f"Reverse the letters of the word '{w}'. Explain briefly, then give the answer.",
        ans,
        f"Reading '{w}' from the last letter to the first gives '{ans}'.",
        explain,
    )


def make_count_letter(rng, explain):
    phrase = " ".join(rng.choice(WORDS) for _ in range(tail_int(rng, 1, 8, 1.2)))
    letters = sorted(set(phrase.replace(" ", "")))
    letter = rng.choice(letters) if rng.random() < 0.9 else rng.choice("jqxz")
    positions = [str(i + 1) for i, ch in enumerate(phrase) if ch == letter]
    ans = str(len(positions))
    if positions:
        where = "position" if len(positions) == 1 else "positions"
        explanation = (
            f"Counting characters from 1 (spaces included), '{letter}' is at "
            f"{where} {join_and(positions)} of '{phrase}'."
        )
    else:
        explanation = f"The letter '{letter}' does not occur in '{phrase}'."
    q = f"How many times does the letter '{letter}' appear in '{phrase}'?"
    return finish(
        f"{q} Answer with the number only.",
        f"{q} Explain briefly, then give the answer.",
        ans,
        explanation,
        explain,
    )


def make_unit_conversion(rng, explain):
    src, one, dst, factor, decimal = rng.choice(UNITS)
    if decimal and rng.random() < 0.5:
        tenths = rng.randint(1, 999)
        value = f"{tenths // 10}.{tenths % 10}"
        result = tenths * factor // 10
    else:
        n = rng.randint(1, 250)
        value, result = str(n), n * factor
    ans = str(result)
    q = f"Convert {value} {src} to {dst}."
    return finish(
        f"{q} Answer with the number only.",
        f"{q} Explain briefly, then give the answer.",
        ans,
        f"1 {one} is {factor} {dst}, so {value} {src} is {value} x {factor} = {result} {dst}.",
        explain,
    )


def _phrase(rng, lo, hi, alpha):
    return " ".join(rng.choice(WORDS + SMALL_WORDS) for _ in range(tail_int(rng, lo, hi, alpha)))


def make_uppercase(rng, explain):
    text = _phrase(rng, 1, 40, 1.1)
    ans = text.upper()
    return finish(
        f"Convert this text to uppercase: '{text}'. Answer with the converted text only.",
        f"Convert this text to uppercase: '{text}'. Say what you did, then give the answer.",
        ans,
        "Every letter is replaced by its capital form; spaces stay as they are.",
        explain,
    )


def make_lowercase(rng, explain):
    words = _phrase(rng, 1, 40, 1.1).split()
    text = " ".join(w.upper() if rng.random() < 0.6 else w.capitalize() for w in words)
    ans = text.lower()
    return finish(
        f"Convert this text to lowercase: '{text}'. Answer with the converted text only.",
        f"Convert this text to lowercase: '{text}'. Say what you did, then give the answer.",
        ans,
        "Every capital letter is replaced by its small form; spaces stay as they are.",
        explain,
    )


def make_sort_words(rng, explain):
    words = rng.sample(WORDS, tail_int(rng, 3, 25, 1.2))
    ans = ", ".join(sorted(words))
    shown = ", ".join(words)
    return finish(
        f"Sort these words alphabetically: {shown}. "
        f"Answer with the sorted words separated by commas only.",
        f"Sort these words alphabetically: {shown}. Explain briefly, then give the answer.",
        ans,
        f"Ordering the {len(words)} words by their letters from a to z, "
        f"'{sorted(words)[0]}' comes first and '{sorted(words)[-1]}' comes last.",
        explain,
    )


def make_capital(rng, explain):
    country = rng.choice(sorted(CAPITALS))
    ans = CAPITALS[country]
    q = rng.choice(
        [
            f"What is the capital of {country}?",
            f"Which city is the capital of {country}?",
            f"Name the capital city of {country}.",
        ]
    )
    return finish(
        f"{q} Answer with the city name only.",
        f"{q} Answer in one sentence, then give the answer.",
        ans,
        f"The capital of {country} is {ans}.",
        explain,
    )


def make_word_count(rng, explain):
    words = _phrase(rng, 2, 60, 1.0).split()
    sentence = " ".join(words)
    sentence = sentence[0].upper() + sentence[1:] + "."
    ans = str(len(words))
    numbered = ", ".join(f"{i + 1} {w}" for i, w in enumerate(sentence.rstrip(".").split()))
    q = f"How many words are in this sentence: \"{sentence}\"?"
    return finish(
        f"{q} Answer with the number only.",
        f"{q} Count them one by one, then give the answer.",
        ans,
        f"Counting the words one by one: {numbered}.",
        explain,
    )


def make_multiples(rng, explain):
    k, n = rng.randint(2, 25), tail_int(rng, 3, 40, 1.0)
    values = [str(k * i) for i in range(1, n + 1)]
    ans = ", ".join(values)
    q = f"List the first {n} multiples of {k}, starting with {k}."
    return finish(
        f"{q} Answer with the numbers separated by commas only.",
        f"{q} Explain briefly, then give the answer.",
        ans,
        f"The multiples of {k} are {k} x 1, {k} x 2, and so on up to {k} x {n} = {k * n}.",
        explain,
    )


def make_max_number(rng, explain):
    nums = [rng.randint(1, 999) for _ in range(tail_int(rng, 3, 30, 1.1))]
    ans = str(max(nums))
    shown = ", ".join(map(str, nums))
    q = f"What is the largest number in this list: {shown}?"
    return finish(
        f"{q} Answer with the number only.",
        f"{q} Explain briefly, then give the answer.",
        ans,
        f"Comparing the {len(nums)} numbers, none is larger than {ans}.",
        explain,
    )


MAKERS = {
    "addition": make_addition,
    "subtraction": make_subtraction,
    "multiplication": make_multiplication,
    "reverse_word": make_reverse_word,
    "count_letter": make_count_letter,
    "unit_conversion": make_unit_conversion,
    "uppercase": make_uppercase,
    "lowercase": make_lowercase,
    "sort_words": make_sort_words,
    "capital": make_capital,
    "word_count": make_word_count,
    "multiples": make_multiples,
    "max_number": make_max_number,
}


def make_rows(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    rows, seen = [], set()
    for task, count in TASK_COUNTS.items():
        made = 0
        while made < count:
            explain = rng.random() < EXPLAIN_FRACTION
            prompt, completion, answer = MAKERS[task](rng, explain)
            if prompt in seen:
                continue
            seen.add(prompt)
            row = {"task": task, "prompt": prompt, "completion": completion, "answer": answer}
            rows.append(row)
            made += 1
    rng.shuffle(rows)
    return [{"id": f"sft-{i:06d}", **row} for i, row in enumerate(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT, help=f"output file (default {OUT})")
    args = parser.parse_args()
    rows = make_rows()
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
