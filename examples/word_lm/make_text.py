"""Write data/train.txt and data/valid.txt: short sentences from a small grammar, with enough structure for a word
model to learn (a subject agrees with its verb, places follow prepositions, a story keeps its characters).

    python make_text.py          # the files shipped with this example were made by this, with the default seed
"""

import random
from pathlib import Path

NAMES = ["anna", "ben", "clara", "david", "emma", "felix", "grace", "henry", "iris", "jonas"]
ANIMALS = ["cat", "dog", "fox", "horse", "owl", "rabbit", "sparrow", "goat"]
PLACES = ["garden", "kitchen", "river", "forest", "market", "station", "library", "harbour", "bridge", "field"]
THINGS = ["letter", "basket", "lamp", "book", "coat", "key", "map", "bottle", "ribbon", "clock"]
ADJECTIVES = ["old", "small", "quiet", "bright", "heavy", "green", "warm", "broken", "careful", "tired"]
ACTS = [("finds", "found"), ("carries", "carried"), ("opens", "opened"), ("hides", "hid"), ("mends", "mended")]
MOVES = [("walks", "walked"), ("runs", "ran"), ("waits", "waited"), ("sleeps", "slept"), ("sings", "sang")]
PREPOSITIONS = ["near", "behind", "beside", "under", "across"]


def sentence(rng: random.Random, cast: list[str], past: bool) -> str:
    who = rng.choice(cast)
    tense = 1 if past else 0
    if rng.random() < 0.5:
        verb = rng.choice(ACTS)[tense]
        described = rng.random() < 0.6
        thing = f"the {rng.choice(ADJECTIVES)} {rng.choice(THINGS)}" if described else f"a {rng.choice(THINGS)}"
        tail = f" {rng.choice(PREPOSITIONS)} the {rng.choice(PLACES)}" if rng.random() < 0.5 else ""
        return f"{who} {verb} {thing}{tail} ."
    verb = rng.choice(MOVES)[tense]
    return f"{who} {verb} {rng.choice(PREPOSITIONS)} the {rng.choice(PLACES)} ."


def story(rng: random.Random) -> str:
    cast = [*rng.sample(NAMES, 2), f"the {rng.choice(ANIMALS)}"]
    past = rng.random() < 0.5
    lines = [sentence(rng, cast, past) for _ in range(rng.randint(3, 7))]
    if rng.random() < 0.4:
        lines.append(f"then {cast[0]} and {cast[1]} {'went' if past else 'go'} home together .")
    return " ".join(lines)


def main(seed: int = 7, train_words: int = 16_000, valid_words: int = 2_500) -> None:
    rng = random.Random(seed)
    here = Path(__file__).parent / "data"
    here.mkdir(exist_ok=True)
    for name, words in (("train.txt", train_words), ("valid.txt", valid_words)):
        lines, count = [], 0
        while count < words:
            line = story(rng)
            lines.append(line)
            count += len(line.split()) + 1  # and the end of the line
        (here / name).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
