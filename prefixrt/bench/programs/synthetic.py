"""Synthetic text of the shapes the SGLang paper's workloads have (no data set can be downloaded here):
deterministic sentences of common English words from a seeded generator, so a workload is the same on every
machine and its prompts tokenize to about one token per word with any of the registry's tokenizers."""

from __future__ import annotations

import random

_WORDS = (
    "the of and to in is was for on that with as by at from this be are or an it not which have has had but "
    "were they their one all there been more when will would can who about many some other into time only "
    "new these two may first then any like over such our than most made after also did between three world "
    "year years state city river north south east west water land people group school part number system "
    "small large long great early later high local during under while since where each well still around "
    "found known called based used named became began built held moved served led gave took made said "
    "market price cost plan team game music film book story paper study report model theory method result "
    "energy field power light sound color stone metal wood glass paper cloth bread fruit coffee train road "
    "bridge tower castle garden forest island valley mountain coast harbor station village county region"
).split()


class SyntheticText:
    """Seeded text: `words(n)`, `sentence(n)` (capitalised, full stop), `passage(n)` (sentences of 8-20 words
    adding up to n words), `name()` (a capitalised two-word name)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(n))

    def sentence(self, n: int) -> str:
        text = self.words(max(1, n))
        return text[0].upper() + text[1:] + "."

    def passage(self, n: int) -> str:
        out, left = [], n
        while left > 0:
            k = min(left, self.rng.randint(8, 20))
            out.append(self.sentence(k))
            left -= k
        return " ".join(out)

    def name(self) -> str:
        return " ".join(w.capitalize() for w in (self.rng.choice(_WORDS), self.rng.choice(_WORDS)))

    def number(self, lo: int = 2, hi: int = 99) -> int:
        return self.rng.randint(lo, hi)
