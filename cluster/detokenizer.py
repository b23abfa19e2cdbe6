"""Incremental detokenization and stop-string detection."""

from __future__ import annotations

import json

_CONTEXT = 5  # prompt tokens kept as left context so spacing decodes correctly
_PIECES = 64  # text pieces kept apart before they are joined (copying the text once every 64 tokens)
# ``tokenizers`` decoders whose text for a token after the first depends on that token alone
# (per-token rules, or ByteLevel's bytes joined before one UTF-8 decode). Not BPEDecoder (its
# end-of-word suffix reads differently on the last token) nor CTC (it merges repeats).
_CONTEXT_FREE_DECODERS = frozenset({"ByteLevel", "WordPiece", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"})
_JOINING_DECODERS = frozenset({"ByteLevel", "Fuse"})  # (what follows them sees one string)


def context_free(config: dict | None) -> bool:
    """Whether a decoder (its JSON) gives each token after the first a text of its own. In a
    ``Sequence``, a decoder after a joining one (Fuse, ByteLevel) acts on the whole text, so
    only Llama 2's ``Strip(start <= 1, stop = 0)`` (the text's first space) may follow."""
    if not config:
        return False
    steps = config.get("decoders", []) if config.get("type") == "Sequence" else [config]
    joined = False
    for d in steps:
        kind = d.get("type") if isinstance(d, dict) else None
        if kind not in _CONTEXT_FREE_DECODERS:
            return False
        if joined and not (kind == "Strip" and d.get("start", 0) <= 1 and d.get("stop", 0) == 0):
            return False
        joined = joined or kind in _JOINING_DECODERS
    return bool(steps)


class TokenTexts:
    """Decodes shared by every sequence of one tokenizer and ``skip_special_tokens`` value
    (decoding is a pure function of the ids): each token's text alone (``single``) and, where
    the tokenizer's decoder is context-free (``context_free``), the text a token
    adds after any other (``after``): steady decoding then costs a dictionary lookup a token
    instead of a decode. A token qualifies when its text after a plain probe token is non-empty
    and holds no U+FFFD (a byte token of a longer UTF-8 character never qualifies)."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        # a fast tokenizer's Rust backend decodes the same text without transformers' per-call
        # Python wrapping (about 4x less driver time per token at large batch sizes)
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.single: dict[int, str] = {}
        self._after: dict[int, str] | None = None
        self._probe: tuple[int, str] | None = None
        if self.backend is not None:
            try:  # (the decoder's own JSON: the whole tokenizer's is megabytes)
                config = json.loads(self.backend.decoder.__getstate__())
            except Exception:  # noqa: BLE001 - no decoder, or a custom one: not known to be context-free
                config = None
            if context_free(config):
                self._probe = self._find_probe()
                self._after = {} if self._probe is not None else None

    def decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip)
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def text(self, token_id: int) -> str:
        t = self.single.get(token_id)
        if t is None:
            t = self.single[token_id] = self.decode([token_id])
        return t

    @property
    def context_free(self) -> bool:
        return self._after is not None

    def after(self, token_id: int) -> str:
        """The text ``token_id`` adds after another token; "" where that depends on context
        (then the window decode decides)."""
        t = self._after.get(token_id)
        if t is None:
            p, p_text = self._probe
            full = self.decode([p, token_id])
            t = full[len(p_text) :] if full.startswith(p_text) else ""
            if "\ufffd" in t:
                t = ""
            self._after[token_id] = t
        return t

    def _find_probe(self) -> tuple[int, str] | None:
        """A plain token (its text alone: ASCII letters or digits) to decode a token after."""
        for i in range(min(self.backend.get_vocab_size(), 4096)):
            t = self.decode([i])
            if t.isascii() and t.isalnum():
                return i, t
        return None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a short window (``prefix_offset`` .. end) per token and holds back
    text that ends in an incomplete UTF-8 sequence (U+FFFD) until it completes. In steady
    decoding (the last token emitted alone) a context-free token's text is looked up instead
    (``TokenTexts.after``).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool, texts: TokenTexts | None = None):
        """``texts``: the decodes shared between the sequences of one tokenizer and
        ``skip_special_tokens`` value (made here when not given)."""
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # the text so far, as the pieces it grew by (appending to one string copies it whole:
        # at batch 256 and thousands of tokens a row, megabytes a step) and its length
        self._parts: list[str] = []
        self.length = 0
        self.texts = texts if texts is not None else TokenTexts(tokenizer, skip_special_tokens)
        if bool(self.texts.skip) != bool(skip_special_tokens):
            raise ValueError("IncrementalDetokenizer: texts decode with another skip_special_tokens")

    @property
    def text(self) -> str:
        """The whole text so far (joined on reading)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def since(self, pos: int) -> str:
        """``text[pos:]``, joining only the pieces it spans."""
        parts, start, i = self._parts, self.length, len(self._parts)
        while i and start > pos:
            i -= 1
            start -= len(parts[i])
        return "".join(parts[i:])[pos - start :]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` characters (a stop string was found)."""
        text = self.text[:n]
        self._parts, self.length = [text] if text else [], len(text)

    def _append(self, delta: str) -> None:
        parts = self._parts
        parts.append(delta)
        self.length += len(delta)
        if len(parts) >= _PIECES:  # (a str object a token would cost more memory than the text)
            self._parts = ["".join(parts)]

    def add(self, token_id: int, final: bool = False) -> str:
        self.ids.append(token_id)
        texts = self.texts
        # steady: the last token was emitted alone, and nothing is held back since
        if texts.context_free and self.read_offset - self.prefix_offset == 1 == len(self.ids) - self.read_offset:
            delta = texts.after(token_id)
            if delta and texts.after(self.ids[self.prefix_offset]):
                self.prefix_offset = self.read_offset
                self.read_offset += 1
                self._append(delta)
                return delta
        return self._emit(final)

    def flush(self) -> str:
        return self._emit(True)

    def _emit(self, final: bool) -> str:
        texts = self.texts
        if self.read_offset - self.prefix_offset == 1:  # steady decoding: the previous token alone
            prefix = texts.text(self.ids[self.prefix_offset])
        else:
            prefix = texts.decode(self.ids[self.prefix_offset : self.read_offset])
        full = texts.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._append(delta)
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
