"""The token byte table (onlinerl/tokens.py) against the real tokenizers, and the byte rule of what was shown.

The table is checked against ``tokenizers``' own decode on real sequences (SmolLM2's byte-level BPE, and a
sentencepiece-style BPE with ``▁`` and ``<0xNN>`` byte fallback built here with the same library); the cut is checked
by hand on texts whose tokens split characters, where vLLM's char offsets drift.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from onlinerl.tokens import TokenTable, TokenTableError, build_token_table, load_token_table, shown_token_count

TEXTS = [
    'print("ありがとう")',
    "café naïve résumé",
    "family 👨‍👩‍👧 and 👩‍💻 done",
    "日本語のテキスト\n\tx = 1",
    "def f(x):\n    return x ** 2  # ünïcödé\n",
    "😀😂🎉 Zürich 北京 Ελληνικά",
    "",
]


@pytest.fixture(scope="module")
def smol(smollm2_path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(smollm2_path / "tokenizer.json")), load_token_table(smollm2_path)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def vllm_text_offsets(tok, ids: list[int]) -> list[int]:
    """vLLM's ``text_offset``: the running sum of ``len(decode([id]))`` (a byte fragment decodes to one U+FFFD)."""
    out, at = [], 0
    for t in ids:
        out.append(at)
        at += len(tok.decode([t]))
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_table_spells_what_the_tokenizer_decodes(smol, text):
    tok, table = smol
    ids = encode(tok, text)
    assert table.text_bytes(ids) == text.encode() == tok.decode(ids).encode()
    eos = 2  # <|im_end|>: special, skipped by vLLM's detokenizer, so it adds no bytes
    assert table.text_bytes([*ids, eos]) == tok.decode([*ids, eos], skip_special_tokens=True).encode()


def test_table_matches_decode_on_random_token_sequences(smol):
    tok, table = smol
    rng = random.Random(15)
    checked = 0
    for _ in range(300):
        ids = [rng.randrange(len(table.pieces)) for _ in range(rng.randint(1, 12))]
        raw = table.text_bytes(ids)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # byte fragments that form no character: decode shows U+FFFD, nothing exact to compare
        assert text == tok.decode(ids), ids
        checked += 1
    assert checked > 100


def test_special_tokens_keep_their_text_when_not_skipped(smollm2_path, smol):
    tok, _ = smol
    table = load_token_table(smollm2_path, skip_special_tokens=False)
    ids = [*encode(tok, "x = 1"), 2]
    assert table.text_bytes(ids) == b"x = 1<|im_end|>" == tok.decode(ids, skip_special_tokens=False).encode()


def test_split_characters_get_their_exact_bytes(smol):
    tok, table = smol
    ids = encode(tok, 'print("ありがとう")')
    pieces = [table.pieces[i] for i in ids]
    assert pieces[2:4] == [b"\xe3\x81", b"\x82"]  # あ is two tokens, neither a character on its own
    assert tok.decode([ids[2]]) == "\ufffd"
    # vLLM's offsets count each fragment as one char: the closing quote is placed 5 chars after where it is.
    assert vllm_text_offsets(tok, ids)[-1] - len('print("ありがとう') == 5


def _sentencepiece_folder(tmp: Path, decoder) -> Path:
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "▁hello": 4, "▁wor": 5, "ld": 6, "é": 7, "▁caf": 8}
    vocab.update({f"<0x{b:02X}>": 9 + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.decoder = decoder
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    return tmp


@pytest.mark.parametrize("style", ["llama", "metaspace"])
def test_sentencepiece_style_byte_fallback(tmp_path, style):
    from tokenizers import Tokenizer, decoders

    if style == "llama":
        decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    folder = _sentencepiece_folder(tmp_path / style, decoder)
    table = load_token_table(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    b = lambda ch: [9 + x for x in ch.encode()]  # noqa: E731 - the byte-fallback ids of one character
    seq = [4, 5, 6, 8, 7, 3, *b("あ"), *b("👩"), 3, 2]  # " hello world café あ👩 </s>", characters as raw bytes
    assert table.text_bytes(seq) == " hello world café あ👩 ".encode()
    # Mid-sequence (a completion after its prompt) nothing is stripped: compare after a leading token.
    assert table.text_bytes(seq) == tok.decode([4, *seq])[len("hello") :].encode()
    assert table.pieces[9 + 0xE3] == b"\xe3" and table.pieces[2] == b""
    k = shown_token_count(table, seq, " hello world café あ👩 ", len(" hello world café あ"), terminator=True)
    assert k == 6 + 3 + 1  # through あ's three byte tokens, plus the first byte of 👩 as the terminator


def test_unsupported_or_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenTableError, match=r"cannot read .*tokenizer\.json"):
        load_token_table(tmp_path)
    from tokenizers import decoders

    folder = _sentencepiece_folder(tmp_path / "wp", decoders.WordPiece())
    with pytest.raises(TokenTableError, match="'WordPiece' is not supported"):
        load_token_table(folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["decoder"] = None  # raw pieces: "▁hello" would be taken literally, and the check against decode agrees
    assert build_token_table(data, {"▁hello": 0}).pieces == ("▁hello".encode(),)


# --- the cut, in bytes ----------------------------------------------------------------------------------------------
def cut(table: TokenTable, ids: list[int], generated: str, shown: str, terminator: bool = True) -> int:
    assert generated.startswith(shown)
    return shown_token_count(table, ids, generated, len(shown), terminator)


def test_japanese_prefix_cut_keeps_exactly_the_shown_tokens(smol):
    tok, table = smol
    text = 'print("ありがとう")'
    ids = [*encode(tok, text), 2]
    assert cut(table, ids, text, text) == len(ids)  # exact: all, EOS too
    k = cut(table, ids, text, 'print("あり', terminator=False)
    assert tok.decode(ids[:k]) == 'print("あり'
    assert cut(table, ids, text, 'print("あり') == k + 1  # + the first fragment of が, the token the display cut on
    # The old char-offset rule on vLLM's offsets kept tokens of が and が's successor as "shown" here.
    offsets = vllm_text_offsets(tok, ids)
    old = sum(1 for i in range(len(ids)) if (offsets[i + 1] if i + 1 < len(ids) else len(text)) <= len('print("あり'))
    assert old < k


def test_every_cut_point_trains_the_shown_bytes_plus_one_terminator(smol):
    """For every char cut of every text: the kept tokens (minus the terminator) lie inside the shown bytes, the
    terminator crosses its end, and nothing after it is kept."""
    tok, table = smol
    for text in TEXTS[:-1]:
        ids = [*encode(tok, text), 2]
        for c in range(len(text) + 1):
            shown = text[:c]
            k = cut(table, ids, text, shown)
            plain = cut(table, ids, text, shown, terminator=False)
            spelled = table.text_bytes(ids[:plain])
            assert shown.encode().startswith(spelled), (text, c)
            if c == len(text):
                assert k == len(ids)
            elif plain == 0:
                assert k == 0
            else:
                assert k == plain + 1
                assert len(table.text_bytes(ids[:k])) > len(shown.encode())  # the terminator ends past the span
                assert table.text_bytes(ids[:k]).startswith(shown.encode())


def test_emoji_with_zwj_and_accents(smol):
    tok, table = smol
    text = "café 👩‍💻 done"
    ids = encode(tok, text)
    assert cut(table, ids, text, "café ", terminator=False) == 3  # c, af, é; " \xf0\x9f" ends past the space
    assert cut(table, ids, text, "café ") == 4
    assert tok.decode(ids[: cut(table, ids, text, "café 👩‍💻", terminator=False)]) == "café 👩‍💻"


def test_hostile_cut_inside_a_characters_tokens(smol):
    """A shown text that ends between the tokens of one character's bytes: the split character's first fragment
    is the terminator, never counted as shown, and nothing past it is kept."""
    tok, table = smol
    text = "おやすみ"
    ids = encode(tok, text)
    assert [len(table.pieces[i]) for i in ids[:2]] == [2, 1]  # お = E3 81 | 8A
    assert cut(table, ids, text, "", terminator=True) == 0  # nothing shown: nothing to attach a terminator to
    k = cut(table, ids, text, "お", terminator=False)
    assert k == 2 and cut(table, ids, text, "お") == 3
    assert table.text_bytes(ids[:3]) == "お".encode() + table.pieces[ids[2]]


def test_inconsistent_tokens_are_never_cut(smol):
    tok, table = smol
    text = "ありがとう"
    ids = encode(tok, text)
    wrong = encode(tok, "あいがとう")  # another text (another tokenizer would look the same)
    assert cut(table, wrong, text, "ありが") == 0
    assert cut(table, wrong, text, text) == len(wrong)  # the whole text shown: every served token, as before
    assert cut(table, [*ids[:2], -1, *ids[3:]], text, "ありが") == 0  # a negative id never wraps around
    assert cut(table, [*ids[:2], 10**9], text, "ありが") == 0  # an id beyond the vocabulary
    assert cut(table, ids[:2], text, "ありが") == 0  # tokens that stop short of the shown text
    assert shown_token_count(None, ids, text, 2) == 0 and shown_token_count(None, ids, text, 5) == len(ids)


def test_bytes_past_the_text_end_belong_to_the_stop(smol):
    """vLLM drops a matched stop string from the text but not its token: exact shows keep it, prefixes cut it."""
    tok, table = smol
    ids = encode(tok, "é\n\nx")
    text = "é"  # stop="\n\n": the text ends before it, the tokens go on
    assert cut(table, ids, text, text) == len(ids)
    assert cut(table, ids, text, "") == 0
