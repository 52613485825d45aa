"""Incremental detokenization: the deltas of a stream add up to the full decode, also over long
outputs, multi-byte characters split across tokens and chunks of several tokens at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = (
    "Plain words, then accents: café, naïve, Ærøskøbing; CJK: 東京は晴れです。"
    " Emoji split across byte tokens: 👩‍💻🚀🧪, math ∮ E⋅da = Q, and code `x += 1`.\n"
)


@pytest.fixture(scope="module")
def tok(embedded_folder: Path) -> Tokenizer:
    return Tokenizer(embedded_folder)


def _stream(tok: Tokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    detok, deltas, i, k = IncrementalDetokenizer(tok), [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        deltas.append(detok.push(ids[i : i + n]))
        i, k = i + n, k + 1
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("sizes", [[1], [1, 3, 2, 7], [16]])
def test_deltas_add_up_to_the_full_decode(tok: Tokenizer, sizes: list[int]) -> None:
    ids = tok.encode(TEXT * 40)  # a long output: thousands of tokens
    assert len(ids) > 2000
    assert any(len(tok.decode([i])) == 1 and tok.decode([i]) == "\ufffd" for i in ids)
    deltas = _stream(tok, ids, sizes)
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)  # no character is ever split


def test_a_dangling_partial_character_is_flushed_as_a_full_decode_writes_it(
    tok: Tokenizer,
) -> None:
    ids = tok.encode("ok 🚀")
    partial = ids[:-1]  # the rocket's last byte token is missing
    deltas = _stream(tok, partial, [1])
    assert "".join(deltas) == tok.decode(partial)
    assert deltas[-1].endswith("\ufffd")
