"""SentencePiece tokenizer.model -> llama.cpp `llama` vocabulary.

Mirrors `_create_vocab_sentencepiece` of llama.cpp's convert_hf_to_gguf.py: pieces, scores and types
from the model, then added tokens from added_tokens.json and the added-token lists of
tokenizer.json / tokenizer_config.json. The model's normalizer spec is read with a small protobuf
wire reader (no protobuf dependency) to reject what llama.cpp's SPM tokenizer cannot reproduce.
"""
from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import gguf

from dsa_convert.errors import BadInputError
from dsa_convert.formats.tokenizer_bpe import does_token_look_special

log = logging.getLogger(__name__)

_UNIGRAM, _BPE = 1, 2


def _pb_fields(buf: bytes):
    """Yield (field number, value) of a protobuf message; value: int (varint/fixed) or bytes."""
    pos, n = 0, len(buf)

    def varint() -> int:
        nonlocal pos
        shift = result = 0
        while True:
            if pos >= n:
                raise ValueError("truncated varint")
            b = buf[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    while pos < n:
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            yield field, varint()
        elif wire == 1:
            yield field, struct.unpack_from("<Q", buf, pos)[0]
            pos += 8
        elif wire == 2:
            size = varint()
            if pos + size > n:
                raise ValueError("truncated field")
            yield field, buf[pos:pos + size]
            pos += size
        elif wire == 5:
            yield field, struct.unpack_from("<I", buf, pos)[0]
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")


def read_spm_specs(path: Path) -> dict:
    """The few ModelProto settings that matter: piece types, model type and the normalizer spec.

    Piece types (NORMAL=1 UNKNOWN=2 CONTROL=3 USER_DEFINED=4 UNUSED=5 BYTE=6) equal gguf.TokenType's.
    """
    spec = {"model_type": _UNIGRAM, "normalizer": "", "add_dummy_prefix": True,
            "remove_extra_whitespaces": True, "treat_whitespace_as_suffix": False, "piece_types": []}
    try:
        for field, value in _pb_fields(path.read_bytes()):
            if field == 1:      # SentencePiece {piece = 1; score = 2; type = 3 [default = NORMAL]}
                kind = [v for f, v in _pb_fields(value) if f == 3]
                spec["piece_types"].append(kind[-1] if kind else 1)
            elif field == 2:    # TrainerSpec
                for f, v in _pb_fields(value):
                    if f == 3:
                        spec["model_type"] = v
                    elif f == 24:
                        spec["treat_whitespace_as_suffix"] = bool(v)
            elif field == 3:    # NormalizerSpec
                for f, v in _pb_fields(value):
                    if f == 1:
                        spec["normalizer"] = v.decode("utf-8")
                    elif f == 3:
                        spec["add_dummy_prefix"] = bool(v)
                    elif f == 4:
                        spec["remove_extra_whitespaces"] = bool(v)
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise BadInputError(f"{path} is not a valid SentencePiece model ({e})") from None
    return spec


def load_spm(model_dir: Path, vocab_size: int | None, added: list[dict]):
    """Return (tokens, scores, token_types, add_space_prefix, spm_special_ids).

    `added`: added-token records ({"id", "content", "special"}) from tokenizer.json /
    tokenizer_config.json; added_tokens.json is read here.
    """
    from sentencepiece import SentencePieceProcessor

    path = model_dir / "tokenizer.model"
    spec = read_spm_specs(path)
    if spec["model_type"] != _BPE:
        kind = {1: "unigram", 3: "word", 4: "char"}.get(spec["model_type"], str(spec["model_type"]))
        raise BadInputError(f"{path} is a SentencePiece {kind} model; llama.cpp's `llama` tokenizer needs BPE")
    if spec["normalizer"] not in ("identity", ""):
        raise BadInputError(f"{path} uses SentencePiece normalization {spec['normalizer']!r}, which llama.cpp's "
                            "`llama` tokenizer does not apply (needs 'identity')")
    if spec["remove_extra_whitespaces"]:
        raise BadInputError(f"{path} has remove_extra_whitespaces=true, which llama.cpp's `llama` tokenizer "
                            "does not apply")
    if spec["treat_whitespace_as_suffix"]:
        raise BadInputError(f"{path} has treat_whitespace_as_suffix=true, which is not supported")

    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(path))
    except (OSError, RuntimeError) as e:
        raise BadInputError(f"cannot load {path}: {e}") from None
    n_pieces = sp.vocab_size()
    if len(spec["piece_types"]) != n_pieces:
        raise BadInputError(f"{path}: {len(spec['piece_types'])} pieces read, sentencepiece reports {n_pieces}")
    added_json = _read_added_tokens_json(model_dir)
    max_added = max([r["id"] for r in added] + list(added_json.values()), default=-1)
    n = max(vocab_size or 0, n_pieces, max_added + 1)

    tokens = [f"[PAD{i}]" for i in range(n)]
    scores = [-10000.0] * n
    types = [int(gguf.TokenType.UNUSED)] * n
    for i in range(n_pieces):
        tokens[i] = sp.IdToPiece(i)
        scores[i] = sp.GetScore(i)
        types[i] = spec["piece_types"][i] if 1 <= spec["piece_types"][i] <= 6 else gguf.TokenType.NORMAL
        if types[i] == gguf.TokenType.USER_DEFINED:
            tokens[i] = tokens[i].replace("\u2581", " ")  # as llama.cpp does for added tokens

    for text, i in added_json.items():
        tokens[i], scores[i], types[i] = text, -1000.0, gguf.TokenType.USER_DEFINED
    for rec in added:
        i, text = rec["id"], rec["content"]
        if types[i] in (gguf.TokenType.UNKNOWN, gguf.TokenType.BYTE) and tokens[i] == text:
            continue  # keep the model's own <unk> / <0xNN> types
        if types[i] != gguf.TokenType.UNUSED and tokens[i] != text:
            log.warning("replacing token %d: %r -> %r", i, tokens[i], text)
        if rec.get("special") or does_token_look_special(text):
            types[i] = gguf.TokenType.CONTROL
        else:
            text = text.replace("\u2581", " ")
            types[i] = gguf.TokenType.USER_DEFINED
        tokens[i], scores[i] = text, -1000.0

    specials = {"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id(), "pad": sp.pad_id()}
    specials = {k: v for k, v in specials.items() if 0 <= v < n}
    return tokens, scores, [int(t) for t in types], spec["add_dummy_prefix"], specials


def _read_added_tokens_json(model_dir: Path) -> dict[str, int]:
    path = model_dir / "added_tokens.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BadInputError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, int) and v >= 0 for v in data.values()):
        raise BadInputError(f"{path} must map token strings to ids")
    return data
