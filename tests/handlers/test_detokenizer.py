"""The incremental detokenizer with SmolLM2's real tokenizer: streamed pieces add up to the full
decode (multi-byte characters split across tokens, invalid byte runs, special tokens), each
piece is what a whole-text detokenizer would release (stop sequences and hold-back included),
and each token costs a decode of a few tokens, not of the whole text."""

from __future__ import annotations

import random

import pytest

from lmserve.handlers.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Grüße aus Köln! 你好，世界 🌍🚀 naïve café — “quotes” and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math.",
    "def f(x):\n    return x ** 2  # ✓ émoji 👩‍👩‍👧‍👦 family\n\n\tTabs and  spaces",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, 日本語のテキスト、한국어 텍스트.",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer(smollm2_dir)


class WholeTextDetokenizer:
    """The previous implementation, which decoded every token so far for each token: the
    reference for what each piece must be."""

    def __init__(self, tokenizer, stop_sequences=()):
        self.tokenizer = tokenizer
        self.stop_sequences = stop_sequences
        self._holdback = max((len(s) for s in stop_sequences), default=1) - 1
        self.token_ids, self.text, self.stopped = [], "", False

    def add(self, token_id):
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        full = self.tokenizer.decode(self.token_ids)
        starts = [full.find(s) for s in self.stop_sequences if s in full]
        if starts:
            self.stopped = True
            return self._release(full[: min(starts)])
        if full.endswith("\ufffd"):
            return ""
        return self._release(full[: max(len(self.text), len(full) - self._holdback)])

    def finish(self):
        return "" if self.stopped else self._release(self.tokenizer.decode(self.token_ids))

    def _release(self, upto):
        piece = upto[len(self.text) :]
        self.text = upto if len(upto) > len(self.text) else self.text
        return piece


def stream(detokenizer, token_ids):
    pieces = [detokenizer.add(token) for token in token_ids]
    pieces.append(detokenizer.finish())
    return pieces


def assert_same_as_whole_text(tokenizer, token_ids, stop_sequences=()) -> bool:
    """Returns whether a stop sequence ended the text."""
    fast = IncrementalDetokenizer(tokenizer, stop_sequences)
    slow = WholeTextDetokenizer(tokenizer, stop_sequences)
    assert stream(fast, token_ids) == stream(slow, token_ids)
    assert fast.text == slow.text and fast.stopped == slow.stopped
    assert fast.token_ids == slow.token_ids
    if not stop_sequences:
        assert fast.text == tokenizer.decode(token_ids)
    return fast.stopped


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_streams_exactly(tokenizer, text):
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert "".join(tokenizer.decode([t]) for t in token_ids) != text  # characters are split
    assert_same_as_whole_text(tokenizer, token_ids)


def test_random_tokens_with_broken_bytes_and_special_tokens_stream_exactly(tokenizer):
    rng = random.Random(0)
    special = sorted(tokenizer.special_ids)
    num_broken = 0
    for _ in range(20):
        token_ids = [rng.randrange(49152) for _ in range(rng.randrange(1, 60))]
        for _ in range(rng.randrange(3)):
            token_ids.insert(rng.randrange(len(token_ids) + 1), rng.choice(special))
        assert_same_as_whole_text(tokenizer, token_ids)
        num_broken += "\ufffd" in tokenizer.decode(token_ids)
    assert num_broken > 5  # the streams did contain invalid byte runs


@pytest.mark.parametrize(
    "stop_sequences",
    [("Köln",), ("🚀",), ("世界", "aus"), (" — “",), ("math.", "never there"), ("ü",)],
)
def test_stop_sequences_end_the_text_as_before(tokenizer, stop_sequences):
    token_ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    assert assert_same_as_whole_text(tokenizer, token_ids, stop_sequences)


def test_stop_sequences_on_random_token_streams(tokenizer):
    rng = random.Random(1)
    text = TEXTS[1] + TEXTS[2]
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(20):
        start = rng.randrange(len(text) - 4)
        stop = text[start : start + rng.randrange(1, 5)]
        assert assert_same_as_whole_text(tokenizer, token_ids, (stop, "zz"))


class CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, token_ids):
        self.lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids)


def test_each_token_decodes_a_small_window(tokenizer):
    token_ids = tokenizer.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, ("never there",))
    text = "".join(stream(detokenizer, token_ids))
    assert text == tokenizer.decode(token_ids) and len(token_ids) > 1000
    assert max(counting.lengths) <= 8  # a long emoji sequence spans a few tokens
    assert sum(counting.lengths) < 5 * len(token_ids)
