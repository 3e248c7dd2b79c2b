"""Bounded output keeps exactly the head and tail of a stream; token truncation keeps halves."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync.sandboxes.output import BoundedStream, OutputCollector, elision_marker, truncate_tokens


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.binary(max_size=40), max_size=30), budget=st.integers(0, 64))
def test_bounded_stream_keeps_exact_head_and_tail_of_any_chunking(chunks: list[bytes], budget: int) -> None:
    stream = BoundedStream(budget)
    for chunk in chunks:
        stream.feed(chunk)
    whole = b"".join(chunks)
    head_n = min(len(whole), budget // 2)
    tail_n = min(len(whole) - head_n, budget - budget // 2)
    assert stream.head == whole[:head_n]
    assert stream.tail == whole[len(whole) - tail_n :]
    assert stream.total == len(whole)
    assert stream.elided == len(whole) - head_n - tail_n


def test_bounded_stream_text_marks_the_elided_byte_count_and_replaces_bad_utf8() -> None:
    stream = BoundedStream(8)
    stream.feed(b"abcd" + b"x" * 100 + b"\xff\xfeyz")
    assert stream.text() == "abcd" + elision_marker(100, "bytes") + "\ufffd\ufffdyz"
    small = BoundedStream(8)
    small.feed("é".encode()[:1])
    small.feed("é".encode()[1:])
    assert small.text() == "é"  # a character split across chunks is not mangled


def test_output_collector_reports_over_cap_on_the_sum_of_both_streams() -> None:
    out = OutputCollector(budget=4, hard_cap=10)
    out.feed(1, b"123456")
    assert not out.over_cap
    out.feed(2, b"12345")
    assert out.over_cap and out.total == 11
    with pytest.raises(ValueError, match="hard output cap \\(3 bytes\\) is below the kept budget \\(4 bytes\\)"):
        OutputCollector(budget=4, hard_cap=3)


class WordTokenizer:
    """Each character is one token (ids are code points): decode(encode(s)) == s."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60), max_tokens=st.integers(0, 70))
def test_truncate_tokens_keeps_head_and_tail_halves_by_token(text: str, max_tokens: int) -> None:
    got = truncate_tokens(text, WordTokenizer(), max_tokens)
    if len(text) <= max_tokens:
        assert got == text
    else:
        head_n = max_tokens // 2
        tail_n = max_tokens - head_n
        expected = text[:head_n] + elision_marker(len(text) - max_tokens, "tokens") + text[len(text) - tail_n :]
        assert got == expected


def test_truncate_tokens_rejects_a_negative_budget() -> None:
    with pytest.raises(ValueError, match="max_tokens must be >= 0, got -1"):
        truncate_tokens("x", WordTokenizer(), -1)
