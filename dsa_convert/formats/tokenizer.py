"""Map a HuggingFace tokenizer to llama.cpp's GGUF vocabulary (tokenizer.ggml.*).

Two kinds are supported:
  * byte-level BPE from tokenizer.json -> tokenizer.ggml.model "gpt2" (see tokenizer_bpe.py);
  * SentencePiece BPE from tokenizer.model -> "llama" (see tokenizer_spm.py), used when there is no
    tokenizer.json or when tokenizer.json is not byte-level (a SentencePiece-derived Llama/Mistral one).

Special token ids, add_bos/add_eos and the chat template follow gguf-py's SpecialVocab: the
tokenizer.json post_processor first, then tokenizer_config.json, config.json, generation_config.json.

    vocab = load_vocab(model_dir, vocab_size)
    write_vocab(gguf_writer, vocab)
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from dsa_convert.errors import BadInputError
from dsa_convert.formats.tokenizer_bpe import load_bpe
from dsa_convert.formats.tokenizer_spm import load_spm

log = logging.getLogger(__name__)

SPECIAL_TYPES = ("bos", "eos", "unk", "pad")


@dataclass
class VocabSpec:
    model: str                              # tokenizer.ggml.model: "gpt2" | "llama"
    pre: str | None                         # tokenizer.ggml.pre ("default" for llama)
    tokens: list[str]                       # ordered by id
    scores: list[float] | None              # llama only
    token_types: list[int]                  # gguf.TokenType values
    merges: list[str] = field(default_factory=list)   # gpt2 only, "a b"
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool | None = None             # None: leave llama.cpp's default
    add_eos: bool | None = None
    add_space_prefix: bool | None = None    # llama only; written when False (llama.cpp default: True)
    chat_template: str | list[dict[str, str]] | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)


def byte_vocab(n: int) -> VocabSpec:
    """A SentencePiece-style vocabulary of exactly n tokens that llama.cpp accepts: <unk> <s> </s>, the 256 byte
    tokens, then filler pieces. For files with random weights (speed benchmarks, the backend build's load check)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    if n < len(tokens) + 1:
        raise BadInputError(f"vocab size {n} too small for a byte vocabulary (need > {len(tokens)})")
    tokens += [f"\u2581t{i}" for i in range(n - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (n - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(n - 259)]
    return VocabSpec(model="llama", pre="default", tokens=tokens, scores=scores, token_types=[int(t) for t in types],
                     bos_id=1, eos_id=2, unk_id=0, add_bos=True)


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BadInputError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise BadInputError(f"{path} does not hold a JSON object")
    return data


def _is_byte_level(tj: dict) -> bool:
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return any(s.get("type") == "ByteLevel" for s in steps)


def _config_vocab_size(config: dict | None) -> int | None:
    if not config:
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


def _added_records(tj: dict | None, tc: dict | None) -> list[dict]:
    """Added tokens as {"id", "content", "special"}: tokenizer.json's, then tokenizer_config's."""
    out = [{"id": int(a["id"]), "content": a["content"], "special": bool(a.get("special"))}
           for a in (tj or {}).get("added_tokens", [])]
    for i, a in ((tc or {}).get("added_tokens_decoder") or {}).items():
        out.append({"id": int(i), "content": a["content"], "special": bool(a.get("special"))})
    return out


def load_vocab(model_dir: Path, vocab_size: int | None = None) -> VocabSpec:
    """Read the tokenizer files of a HuggingFace checkpoint directory.

    vocab_size: rows of the embedding matrix (default: config.json's vocab_size). The token list has
    max(vocab_size, number of tokenizer ids) entries; missing ids become UNUSED `[PAD{id}]` tokens.
    """
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    if vocab_size is None:
        vocab_size = _config_vocab_size(config)
    tc = _read_json(model_dir / "tokenizer_config.json") or {}
    tj = _read_json(model_dir / "tokenizer.json")
    has_spm = (model_dir / "tokenizer.model").is_file()

    if tj is not None and (_is_byte_level(tj) or not has_spm):
        if not _is_byte_level(tj) and (tj.get("model") or {}).get("type") == "BPE" \
                and (tj["model"].get("byte_fallback") or tj.get("pre_tokenizer") is None):
            raise BadInputError(f"{model_dir / 'tokenizer.json'} is a SentencePiece-style BPE (not byte-level) "
                                f"and {model_dir} has no tokenizer.model")
        clean = tc.get("clean_up_tokenization_spaces")
        tokens, types, merges, pre = load_bpe(tj, vocab_size, clean if isinstance(clean, bool) else None)
        vocab = VocabSpec("gpt2", pre, tokens, None, types, merges)
        fallback: dict[str, int] = {}
    elif has_spm:
        tokens, scores, types, prefix, fallback = load_spm(model_dir, vocab_size, _added_records(tj, tc))
        vocab = VocabSpec("llama", "default", tokens, scores, types)
        vocab.add_space_prefix = None if prefix else False
    else:
        raise BadInputError(f"no tokenizer found in {model_dir} (expected tokenizer.json or tokenizer.model)")

    _check_unique(vocab.tokens)
    _set_specials(vocab, model_dir, tj, tc, config, fallback)
    vocab.chat_template = _chat_template(model_dir, tc)
    return vocab


def _check_unique(tokens: list[str]) -> None:
    # llama.cpp maps text -> id and asserts that no two ids share a text
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in seen:
            raise BadInputError(f"token {t!r} appears twice in the vocabulary (ids {seen[t]} and {i}); "
                                "llama.cpp needs distinct token texts")
        seen[t] = i


def _token_text(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def _first_int(value: Any) -> int | None:
    if isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _post_processor_flags(tj: dict | None) -> tuple[dict[str, bool], dict[str, int]]:
    """add_bos/add_eos from tokenizer.json's post_processor, and the ids its template adds."""
    flags: dict[str, bool] = {}
    ids: dict[str, int] = {}
    post = (tj or {}).get("post_processor")
    if not post:
        return flags, ids
    for proc in post.get("processors", [post]):
        kind = proc.get("type")
        if kind == "ByteLevel":
            flags.setdefault("bos", False)
            flags.setdefault("eos", False)
        elif kind in ("RobertaProcessing", "BertProcessing"):
            flags["bos"] = flags["eos"] = True
            for typ, key in (("bos", "cls"), ("eos", "sep")):
                if isinstance(proc.get(key), list) and len(proc[key]) == 2:
                    ids[typ] = int(proc[key][1])
        elif kind == "TemplateProcessing":
            single = proc.get("single") or []
            specials = proc.get("special_tokens") or {}
            for typ, item in (("bos", single[0] if single else {}), ("eos", single[-1] if single else {})):
                name = (item.get("SpecialToken") or {}).get("id")
                flags[typ] = name is not None and len(single) > 1
                token_ids = (specials.get(name) or {}).get("ids") if name is not None else None
                if flags[typ] and token_ids:
                    ids[typ] = int(token_ids[0])
    return flags, ids


def _set_specials(vocab: VocabSpec, model_dir: Path, tj: dict | None, tc: dict,
                  config: dict | None, fallback: dict[str, int]) -> None:
    n = vocab.vocab_size
    by_text: dict[str, int] = {}
    for i, t in enumerate(vocab.tokens):
        by_text.setdefault(t, i)
    for rec in _added_records(tj, tc):        # added tokens by their raw content
        by_text[rec["content"]] = rec["id"]
    gen = _read_json(model_dir / "generation_config.json") or {}
    cfg = config or {}
    flags, template_ids = _post_processor_flags(tj)

    for typ in SPECIAL_TYPES:
        text = _token_text(tc.get(f"{typ}_token"))
        candidates = [
            (f"tokenizer_config.json {typ}_token", by_text.get(text) if text is not None else None),
            ("tokenizer.json post_processor", template_ids.get(typ)),
            (f"config.json {typ}_token_id", _first_int(cfg.get(f"{typ}_token_id"))),
            (f"config.json text_config.{typ}_token_id",
             _first_int((cfg.get("text_config") or {}).get(f"{typ}_token_id"))),
            (f"generation_config.json {typ}_token_id", _first_int(gen.get(f"{typ}_token_id"))),
            ("tokenizer.model", fallback.get(typ)),
        ]
        if text is not None and by_text.get(text) is None:
            log.warning("tokenizer_config.json %s_token %r is not in the vocabulary - ignored", typ, text)
        for source, tid in candidates:
            if tid is None:
                continue
            if 0 <= tid < n:
                setattr(vocab, f"{typ}_id", tid)
                break
            log.warning("%s = %d is outside the vocabulary (%d tokens) - ignored", source, tid, n)

    for typ in ("bos", "eos"):
        value = flags.get(typ)
        if value and typ in template_ids and template_ids[typ] != getattr(vocab, f"{typ}_id"):
            log.warning("tokenizer.json post_processor adds token %d, not the %s token %s - add_%s_token off",
                        template_ids[typ], typ, getattr(vocab, f"{typ}_id"), typ)
            value = False
        config_value = tc.get(f"add_{typ}_token")
        if value is None and isinstance(config_value, bool):
            value = config_value
        elif isinstance(config_value, bool) and config_value != value:
            log.warning("tokenizer_config.json add_%s_token=%s disagrees with tokenizer.json post_processor (%s) "
                        "- using the latter", typ, config_value, value)
        setattr(vocab, f"add_{typ}", value)


def _chat_template(model_dir: Path, tc: dict) -> str | list[dict[str, str]] | None:
    template = tc.get("chat_template")
    if isinstance(template, (str, list)):
        return template
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    data = _read_json(model_dir / "chat_template.json")
    if data and isinstance(data.get("chat_template"), (str, list)):
        return data["chat_template"]
    return None


def write_vocab(writer: gguf.GGUFWriter, vocab: VocabSpec) -> None:
    """Add the tokenizer.ggml.* keys of `vocab` to a GGUF writer."""
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.token_types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    for typ in SPECIAL_TYPES:
        tid = getattr(vocab, f"{typ}_id")
        if tid is not None:
            getattr(writer, f"add_{typ}_token_id")(tid)
    if vocab.add_bos is not None:
        writer.add_add_bos_token(vocab.add_bos)
    if vocab.add_eos is not None:
        writer.add_add_eos_token(vocab.add_eos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)
