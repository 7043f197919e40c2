"""Needle-in-a-haystack prompts: the three formats the long-context reference model was trained on
(models/ref-llama-27m-32k/README.md), what a trial's seed decides, and fitting a prompt to a token budget.

* ``passkey``: llama.cpp examples/passkey. Prefix PASSKEY_PREFIX, then the filler with
  `` The pass key is V. Remember it. V is the pass key.`` inserted, then `` What is the pass key? The pass key is``;
  V in 1..50000.
* ``niah`` (RULER single needle): `` One of the special magic numbers for KEY is: V.`` inside the filler, then
  `` What is the special magic number for KEY mentioned in the provided text? The special magic number for KEY
  mentioned in the provided text is``; V has 7 digits, KEY is two words of ADJECTIVES / NOUNS joined by ``-``.
* ``multikey``: four such needles with different keys and values at different depths; the one at the grid's depth
  is asked.

niah and multikey have no prefix (the README documents none): the prompt is BOS + filler
with the needle(s) + question. The whole prompt text is tokenized at once, as llama-passkey does, and the amount of
filler is searched so that the prompt has as many tokens as the budget allows (`fit_prompt`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from ..errors import BadInputError
from .needle_filler import Haystack

TASKS = ("passkey", "niah", "multikey")

PASSKEY_PREFIX = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                  "I will quiz you about the important information there.")
PASSKEY_QUESTION = " What is the pass key? The pass key is"
PASSKEY_RANGE = (1, 50000)
MAGIC_RANGE = (1_000_000, 9_999_999)     # 7 digits
MULTIKEY_NEEDLES = 4

# words of the niah / multikey keys (adjective-noun, e.g. amber-lake)
ADJECTIVES = ("amber", "ancient", "bitter", "bold", "brave", "bright", "calm", "clever", "cold", "crimson", "dark",
              "eager", "early", "fancy", "gentle", "golden", "green", "hidden", "hollow", "honest", "icy", "jolly",
              "lively", "lucky", "misty", "narrow", "noble", "proud", "quiet", "rapid", "rough", "rusty", "silent",
              "silver", "smooth", "steady", "swift", "tall", "velvet", "wild")
NOUNS = ("anchor", "apple", "arrow", "badger", "bell", "bridge", "castle", "cloud", "comet", "dragon", "falcon",
         "forest", "garden", "harbor", "island", "lake", "lantern", "meadow", "mirror", "mountain", "orchard", "otter",
         "pepper", "pillar", "planet", "raven", "river", "saddle", "shadow", "spring", "stone", "storm", "summit",
         "thunder", "tiger", "tower", "valley", "violin", "willow", "window")


def passkey_needle(value: int) -> str:
    return f" The pass key is {value}. Remember it. {value} is the pass key."


def magic_needle(key: str, value: int) -> str:
    return f" One of the special magic numbers for {key} is: {value}."


def magic_question(key: str) -> str:
    return (f" What is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is")


@dataclass(frozen=True)
class TrialContent:
    """What a trial's seed decides: the needles (the first is the one asked), where the others sit and where the
    filler starts. The same seed gives the same content whatever the model, attention mode or KV cache."""
    task: str
    prefix: str
    needles: tuple[str, ...]
    values: tuple[int, ...]
    keys: tuple[str, ...]             # empty for passkey
    question: str
    other_depths: tuple[float, ...]   # fractions 0..1 of the needles after the first
    filler_start: float               # fraction 0..1: which eligible paragraph the filler starts at

    @property
    def expected(self) -> int:
        return self.values[0]


def trial_content(task: str, seed: int) -> TrialContent:
    if task not in TASKS:
        raise BadInputError(f"unknown --needle {task!r} (choose from {', '.join(TASKS)})")
    rng = random.Random(seed)
    if task == "passkey":
        v = rng.randint(*PASSKEY_RANGE)
        return TrialContent(task, PASSKEY_PREFIX, (passkey_needle(v),), (v,), (), PASSKEY_QUESTION, (), rng.random())
    n = 1 if task == "niah" else MULTIKEY_NEEDLES
    pairs = rng.sample([(a, b) for a in ADJECTIVES for b in NOUNS], n)
    keys = tuple(f"{a}-{b}" for a, b in pairs)
    values: list[int] = []
    while len(values) < n:
        v = rng.randint(*MAGIC_RANGE)
        if v not in values:
            values.append(v)
    others = tuple(rng.random() for _ in range(n - 1))
    return TrialContent(task, "", tuple(magic_needle(k, v) for k, v in zip(keys, values)), tuple(values), keys,
                        magic_question(keys[0]), others, rng.random())


def _nearest_free(bounds: list[int], target: float, taken: set[int]) -> int:
    """Index into `bounds` of the boundary nearest `target` (characters) not in `taken` (any, if all are)."""
    order = sorted(range(len(bounds)), key=lambda i: (abs(bounds[i] - target), i))
    return next((i for i in order if i not in taken), order[0])


@dataclass(frozen=True)
class PromptText:
    text: str
    needle_pos: float      # where the asked needle sits, as a fraction of the filler's characters


def compose(content: TrialContent, hay: Haystack, depth: float) -> PromptText:
    """prefix + filler with the needles at the boundaries nearest their depths + question. depth: 0..1 of the asked
    needle; the others at content.other_depths, each at a boundary of its own where the filler has enough."""
    n = len(hay.text)
    taken: set[int] = set()
    placed: list[tuple[int, int]] = []          # (char position, needle index)
    for i, d in enumerate((depth,) + content.other_depths):
        b = _nearest_free(hay.bounds, d * n, taken)
        taken.add(b)
        placed.append((hay.bounds[b], i))
    parts, at = [], 0
    for pos, i in sorted(placed):
        parts.append(hay.text[at:pos])
        parts.append(content.needles[i])
        at = pos
        if pos < n and not hay.text[pos].isspace():   # a needle before a paragraph's first word
            parts.append(" ")
    parts.append(hay.text[at:])
    body = "".join(parts)
    sep = " " if content.prefix and body and not body[0].isspace() else ""
    return PromptText(content.prefix + sep + body + content.question, placed[0][0] / n if n else 0.0)


@dataclass(frozen=True)
class FittedPrompt:
    text: str
    tokens: list[int]
    units: int             # filler units used (junk repeats or characters)
    needle_pos: float


def fit_prompt(build: Callable[[int], PromptText], tokenize: Callable[[str], list[int]], budget: int,
               max_units: int | None, hint: int, units_per_token: float, length: int) -> FittedPrompt:
    """The prompt with the most filler units whose tokenization has at most `budget` tokens: secant steps from
    `hint` (an estimate) on the token gap, then an upward gallop where no probe overshot yet, then bisection. Every
    returned prompt was tokenized and checked against the budget. max_units None: unlimited filler (junk). A filler
    exhausted before the budget is reached is bad input."""
    by_text: dict[str, list[int]] = {}
    prompts: dict[int, PromptText] = {}

    def probe(u: int) -> tuple[PromptText, list[int]]:
        if u not in prompts:
            prompts[u] = build(u)
        p = prompts[u]
        if p.text not in by_text:          # units cut back to the same word boundary give the same text
            by_text[p.text] = tokenize(p.text)
        return p, by_text[p.text]

    def n_tokens(u: int) -> int:
        return len(probe(u)[1])

    fixed = n_tokens(0)
    if fixed > budget:
        raise BadInputError(f"length {length} is too small for the prompt's fixed parts: {fixed} tokens without any "
                            f"filler, and {length - budget} tokens are kept for the answer")
    cap = max_units if max_units is not None else 1 << 40
    lo, hi = 0, None                        # lo fits; hi (once known) does not
    u = min(max(1, hint), cap)
    for _ in range(8):
        t = n_tokens(u)
        if t <= budget:
            lo = max(lo, u)
        else:
            hi = u if hi is None else min(hi, u)
        if lo >= cap or (hi is not None and hi - lo <= 1):
            break
        nxt = min(cap, u + int((budget - t) * units_per_token))
        nxt = max(nxt, lo + 1)
        if hi is not None:
            nxt = min(nxt, hi - 1)
        if nxt == u:
            break
        u = nxt
    step = max(1, int(8 * units_per_token))
    while hi is None:                       # gallop up until a probe overshoots or the filler runs out
        if lo >= cap:
            raise BadInputError(f"the filler is too short for length {length}: all of it ({cap} characters) makes "
                                f"a prompt of {n_tokens(lo)} tokens, fewer than the {budget} wanted "
                                "(use a longer --filler file)")
        nxt = min(cap, lo + step)
        if n_tokens(nxt) <= budget:
            lo, step = nxt, step * 2
        else:
            hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if n_tokens(mid) <= budget:
            lo = mid
        else:
            hi = mid
    p, toks = probe(lo)
    return FittedPrompt(p.text, toks, lo, p.needle_pos)
