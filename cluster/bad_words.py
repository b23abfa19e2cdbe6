"""``SamplingParams.bad_words``: words the output never contains (vLLM's semantics).

Each word is tokenized as it stands and after a space (``"word"`` and ``" word"``: the same
word at the start of the text and inside it), without special tokens. A word of one token is
banned outright: it travels as the request's ``SamplingOptions.banned_token_ids`` and the
device masks it every step. A word of several tokens bans its last token only where the
output so far ends with the others: that needs the output's last tokens, so such a request
carries a ``BadWordsMatcher`` in place of (or around) its structured-output matcher, and,
like one, samples only once its previous token is confirmed (``cluster.structured_output``).
"""

from __future__ import annotations

import numpy as np


def bad_word_sequences(tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """The distinct token sequences of ``words``, each word bare and after a space."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seqs[ids] = None
    return list(seqs)


class BadWordsMatcher:
    """The multi-token bad words of one sequence, over the tokens it outputs; optionally
    around a structured-output matcher (``inner``), whose mask it narrows. The scheduler
    drives it as it drives a ``RequestGrammar`` (``bitmask``, ``accept``, ``terminated``)."""

    def __init__(self, sequences: list[tuple[int, ...]], vocab_size: int, inner=None):
        self.sequences = [s for s in sequences if len(s) > 1]
        self.words = (vocab_size + 31) // 32
        self.inner = inner
        self.tail: list[int] = []  # the output's last tokens, as many as the longest prefix
        self._keep = max(len(s) for s in self.sequences) - 1

    def bitmask(self) -> bytes:
        """The tokens allowed next (``RequestGrammar.bitmask``'s layout)."""
        if self.inner is not None:
            mask = np.frombuffer(self.inner.bitmask(), dtype="<u4").copy()
        else:
            mask = np.full(self.words, 0xFFFFFFFF, dtype="<u4")
        for seq in self.sequences:
            prefix = seq[:-1]
            if len(self.tail) >= len(prefix) and tuple(self.tail[len(self.tail) - len(prefix) :]) == prefix:
                last = seq[-1]
                mask[last >> 5] &= np.uint32(~(1 << (last & 31)) & 0xFFFFFFFF)
        return mask.tobytes()

    def can_start(self) -> bool:
        return self.inner is None or self.inner.can_start()

    def accept(self, token: int) -> bool:
        if self.inner is not None and not self.inner.accept(token):
            return False
        self.tail = (self.tail + [token])[-self._keep :]
        return True

    @property
    def terminated(self) -> bool:
        return self.inner is not None and self.inner.terminated
