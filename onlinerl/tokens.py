"""Each token id's exact UTF-8 bytes, and which generated tokens a shown text covers: computed in bytes, never chars.

Why bytes: a byte-level BPE token may hold part of a multi-byte character (``ありがとう`` splits into tokens of one or
two bytes each), so a token has no char length of its own. vLLM's ``text_offset`` adds up ``len(decode([id]))``, and a
fragment decodes to U+FFFD (one char), so its offsets drift ahead on any non-ASCII text. Here each token maps to its
bytes, the generated text is encoded once, and a token counts as *shown* iff its last byte lies inside the shown bytes.

The table is built from the model folder's ``tokenizer.json`` (the ``tokenizers`` library only, no transformers, so
the feedback service starts fast) by replaying its decoder per token: byte-level BPE through the GPT-2
bytes<->unicode map, sentencepiece-style ``▁`` -> space and ``<0xNN>`` byte fallback. Special tokens give no bytes,
as vLLM detokenizes with ``skip_special_tokens`` (its default; the gateway does not change it), so EOS adds nothing to
the generated text; pass ``skip_special_tokens=False`` for their text. The table is checked against the tokenizer's
own decode of every token at load (:func:`load_token_table`), so an unsupported decoder fails start-up instead of
cutting samples wrongly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenTableError(RuntimeError):
    """The tokenizer cannot be turned into a byte table; the message says what to fix."""


def gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's map from the printable stand-in char of each byte back to the byte (byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


@dataclass(frozen=True)
class TokenTable:
    """``pieces[id]``: the bytes token ``id`` adds to the detokenized text (None: no such id in the vocabulary)."""

    pieces: tuple[bytes | None, ...]
    strips_leading_space: bool = False  # sentencepiece decoders drop the first space of a whole sequence only

    def piece(self, token_id: int) -> bytes | None:
        return self.pieces[token_id] if 0 <= token_id < len(self.pieces) else None

    def text_bytes(self, token_ids: Sequence[int]) -> bytes | None:
        """The bytes the ids spell (mid-sequence, as a completion after its prompt), or None for an unknown id."""
        out = []
        for t in token_ids:
            piece = self.piece(t)
            if piece is None:
                return None
            out.append(piece)
        return b"".join(out)


def shown_token_count(
    table: TokenTable | None, token_ids: Sequence[int], generated: str, shown_end: int, terminator: bool = False
) -> int:
    """How many leading tokens of ``token_ids`` (which generated ``generated``) were shown, when the user saw
    ``generated[:shown_end]`` (a char index), plus with ``terminator`` the token the display was cut on.

    A token is shown iff its last byte lies within the first ``len(generated[:shown_end].encode())`` bytes; a token
    with no bytes (EOS, a skipped special token) iff it ends there. When the whole generated text was shown, every
    token was (bytes vLLM never put in the text, a matched stop string or an unfinished character at the end, are
    part of the decision to stop there). The terminator is the next token after the shown ones, when at least one
    whole token was shown and the generation went on (see onlinerl_feedback/join.py).

    Without a table, or when the tokens do not spell the shown bytes (an unknown id, another tokenizer), no cut is
    safe: all tokens count only if the whole text was shown, else none.
    """
    n = len(token_ids)
    if shown_end >= len(generated):
        return n
    shown = generated[:shown_end].encode()
    limit = len(shown)
    kept, end = 0, 0
    pieces = () if table is None else table.pieces
    size = len(pieces)
    for t in token_ids:
        if not 0 <= t < size:
            return 0
        piece = pieces[t]
        if piece is None:
            return 0
        nxt = end + len(piece)
        if nxt > limit:
            if shown[end:] != piece[: limit - end]:
                return 0  # the tokens spell something else inside the shown span
            break
        if shown[end:nxt] != piece:
            return 0
        end = nxt
        kept += 1
    else:
        if end < limit:
            return 0  # the tokens stop short of the shown text: not what generated it
    if terminator and 0 < kept < n:  # no whole token shown: nothing to attach a terminator to
        kept += 1
    return kept


# --- building the table from tokenizer.json ----------------------------------------------------------------------


def _decoder_steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [step for d in decoder.get("decoders") or () for step in _decoder_steps(d)]
    return [decoder]


def _replace_pattern(step: dict[str, Any]) -> str:
    pattern = step.get("pattern") or {}
    if "String" not in pattern:
        raise TokenTableError(f"tokenizer decoder Replace with a regex pattern ({pattern}) is not supported")
    return pattern["String"]


def _piece_bytes(token: str, steps: list[dict[str, Any]], byte_map: dict[str, int]) -> bytes:
    """One token through the decoder steps that act per token (the others only join or trim a whole sequence)."""
    text: str | bytes = token
    for step in steps:
        kind = step.get("type")
        if isinstance(text, bytes):
            break
        if kind == "ByteLevel":
            # tokenizers maps a token through the table only when every char is in it, else keeps its UTF-8 as is.
            if all(ch in byte_map for ch in text):
                text = bytes(byte_map[ch] for ch in text)
        elif kind == "ByteFallback":
            m = _BYTE_FALLBACK.match(text)
            if m:
                text = bytes([int(m.group(1), 16)])
        elif kind == "Replace":
            text = text.replace(_replace_pattern(step), step.get("content", ""))
        elif kind == "Metaspace":
            text = text.replace(step.get("replacement", "▁"), " ")
        elif kind in ("Fuse", "Strip"):
            continue
        else:
            raise TokenTableError(f"tokenizer decoder {kind!r} is not supported by the byte table (onlinerl/tokens.py)")
    return text if isinstance(text, bytes) else text.encode("utf-8")


def _strips_leading_space(steps: list[dict[str, Any]]) -> bool:
    for step in steps:
        if step.get("type") == "Strip" and step.get("start", 0) > 0:
            return True
        if step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never":
            return True
    return False


def build_token_table(tokenizer_json: dict[str, Any], vocab: dict[str, int], skip_special_tokens: bool = True):
    """The table from a parsed tokenizer.json and its full vocabulary (token string -> id, added tokens included)."""
    steps = _decoder_steps(tokenizer_json.get("decoder"))
    byte_map = gpt2_unicode_to_byte()
    size = max(vocab.values(), default=-1) + 1
    pieces: list[bytes | None] = [None] * size
    for token, token_id in vocab.items():
        pieces[token_id] = _piece_bytes(token, steps, byte_map)
    for added in tokenizer_json.get("added_tokens") or ():
        if added.get("special") and skip_special_tokens and 0 <= added["id"] < size:
            pieces[added["id"]] = b""
    return TokenTable(tuple(pieces), _strips_leading_space(steps))


def check_against_decode(table: TokenTable, tokenizer: Any, skip_special_tokens: bool = True) -> list[int]:
    """Ids whose table bytes disagree with ``tokenizer.decode([id])`` (a ``tokenizers.Tokenizer``); byte fragments,
    which decode to U+FFFD, are skipped: whole sequences are what the tests compare for them."""
    ids = [i for i, p in enumerate(table.pieces) if p is not None]
    decoded = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=skip_special_tokens)
    bad = []
    for token_id, text in zip(ids, decoded, strict=True):
        try:
            expected = table.pieces[token_id].decode("utf-8")  # type: ignore[union-attr]
        except UnicodeDecodeError:
            continue
        if text != expected and not (table.strips_leading_space and expected.startswith(" ") and text == expected[1:]):
            bad.append(token_id)
    return bad


def load_token_table(model_folder: str | Path, skip_special_tokens: bool = True) -> TokenTable:
    """The byte table of the model folder's tokenizer, verified token by token; TokenTableError says what is wrong."""
    path = Path(model_folder) / TOKENIZER_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenTableError(
            f"cannot read {path} ({exc}): the model folder needs a fast tokenizer file; save one with "
            "transformers' AutoTokenizer.from_pretrained(folder).save_pretrained(folder)"
        ) from None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception
        raise TokenTableError(f"{path} is not a tokenizer the tokenizers library can load: {exc}") from None
    table = build_token_table(data, tokenizer.get_vocab(with_added_tokens=True), skip_special_tokens)
    bad = check_against_decode(table, tokenizer, skip_special_tokens)
    if bad:
        sample = ", ".join(f"{i}={tokenizer.id_to_token(i)!r}" for i in bad[:5])
        raise TokenTableError(
            f"{path}: the byte table disagrees with the tokenizer's decode on {len(bad)} tokens ({sample}); "
            "this decoder is not supported by onlinerl/tokens.py"
        )
    return table
