"""A tiny generated corpus for the examples: no downloads, fully deterministic.

Sentences come from a small grammar ("the old cat sees a red ball near the
tree."), so a small character-level model can learn spelling, word order and
punctuation within a few dozen steps and the loss visibly falls.
"""

import random

ADJECTIVES = ["big", "small", "red", "old", "quick", "lazy", "happy", "green"]
NOUNS = ["cat", "dog", "bird", "fox", "girl", "boy", "ball", "tree", "house", "river"]
VERBS = ["sees", "likes", "chases", "finds", "jumps over", "walks to", "hears"]
PLACES = ["near the", "under the", "behind the", "in the"]


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(["the", "a"])]
    if rng.random() < 0.6:
        words.append(rng.choice(ADJECTIVES))
    words.append(rng.choice(NOUNS))
    return " ".join(words)


def sentence(rng: random.Random) -> str:
    s = f"{_noun_phrase(rng)} {rng.choice(VERBS)} {_noun_phrase(rng)}"
    if rng.random() < 0.4:
        s += f" {rng.choice(PLACES)} {rng.choice(NOUNS)}"
    return s + ". "


def generate(num_chars: int = 200_000, seed: int = 0) -> str:
    """Return at least `num_chars` characters of generated text (same on every rank)."""
    rng = random.Random(seed)
    parts, n = [], 0
    while n < num_chars:
        parts.append(sentence(rng))
        n += len(parts[-1])
    return "".join(parts)


if __name__ == "__main__":
    print(generate(400))
