"""Incremental detokenization and stop-string detection."""

from __future__ import annotations

_CONTEXT = 5  # prompt tokens kept as left context so spacing decodes correctly


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a short window (``prefix_offset`` .. end) per token and holds back
    text that ends in an incomplete UTF-8 sequence (U+FFFD) until it completes.
    """

    def __init__(
        self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool, token_text: dict[int, str] | None = None
    ):
        """``token_text``: a cache of single-token decodes to share between the sequences of
        one tokenizer and ``skip_special_tokens`` value (decoding is a pure function of ids)."""
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        # a fast tokenizer's Rust backend decodes the same text without transformers' per-call
        # Python wrapping (about 4x less driver time per token at large batch sizes)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._token_text = token_text if token_text is not None else {}

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip)
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add(self, token_id: int, final: bool = False) -> str:
        self.ids.append(token_id)
        return self._emit(final)

    def flush(self) -> str:
        return self._emit(True)

    def _emit(self, final: bool) -> str:
        if self.read_offset - self.prefix_offset == 1:  # steady decoding: the previous token alone
            t = self.ids[self.prefix_offset]
            prefix = self._token_text.get(t)
            if prefix is None:
                prefix = self._token_text[t] = self._decode([t])
        else:
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that overlaps the last ``new_len`` characters of ``text``."""
    best = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
