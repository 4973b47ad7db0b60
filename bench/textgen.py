"""Deterministic texts with exact token counts.

Texts are built from whole-word vocabulary entries that the tokenizer maps to exactly one token each, so a
text of ``n`` tokens (special tokens included) is ``n - specials`` such words joined by spaces. Every
length is checked against the tokenizer, so the counts the report uses are exact, not estimates.
"""
from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path
from typing import Sequence


class TextGen:
    def __init__(self, tokenizer, seed: int = 1234):
        self.tok = tokenizer  # a `tokenizers.Tokenizer`
        self.seed = seed
        self.rng = random.Random(seed)
        self.specials = len(tokenizer.encode("", add_special_tokens=True).ids)
        vocab = tokenizer.get_vocab()
        words = sorted(
            w for w in vocab
            if w.isascii() and w.isalpha() and w.islower() and 3 <= len(w) <= 10
        )
        single = []
        # keep only words that round-trip as exactly one token
        for i in range(0, len(words), 512):
            chunk = words[i:i + 512]
            for w, enc in zip(chunk, tokenizer.encode_batch(chunk, add_special_tokens=False)):
                if len(enc.ids) == 1:
                    single.append(w)
        if len(single) < 100:
            raise RuntimeError("tokenizer has too few single-token words for the text generator")
        self.words = single

    def text(self, n_tokens: int) -> str:
        """One text whose encoding (with special tokens) is exactly ``n_tokens`` long."""
        n = max(1, n_tokens - self.specials)
        return " ".join(self.rng.choice(self.words) for _ in range(n))

    def texts(self, n: int, n_tokens: int | tuple[int, int]) -> list[str]:
        """``n`` texts of ``n_tokens`` tokens, or of lengths drawn uniformly from ``(lo, hi)``."""
        if isinstance(n_tokens, tuple):
            lo, hi = n_tokens
            return [self.text(self.rng.randint(lo, hi)) for _ in range(n)]
        return [self.text(n_tokens) for _ in range(n)]

    def count(self, texts: Sequence[str]) -> list[int]:
        return [len(e.ids) for e in self.tok.encode_batch(list(texts), add_special_tokens=True)]


@lru_cache(maxsize=4)
def load_tokenizer(model_dir: str | Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok
