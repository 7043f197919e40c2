"""Byte-level BPE (tokenizer.json) -> llama.cpp `gpt2` vocabulary.

`tokenizer.ggml.pre` is chosen by recognising the pre-tokenizer regexes themselves (the `Split`
patterns, `Digits` and `ByteLevel(use_regex)` of tokenizer.json's `pre_tokenizer`), not by hashing
token outputs as llama.cpp's convert_hf_to_gguf.py does. The regexes come from llama.cpp's
src/llama-vocab.cpp (`llm_tokenizer_bpe`) and from the models' own tokenizer.json files.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf

from dsa_convert.errors import BadInputError

# GPT-2's regex: what ByteLevel(use_regex=true) applies. llama.cpp spells it without the final
# `|\s+`, but its hand-written splitter for it matches the HF behaviour (trailing whitespace too).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_GPT2_LLAMACPP = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama-3 (tiktoken cl100k-like): letters with one leading non-letter, numbers in groups of 1-3.
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 / Qwen2.5 / Qwen3: as Llama-3 but digits one by one.
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: letters include combining marks.
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o / Llama-4 (o200k-like).
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DS_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DS_LETTERS = (
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DS_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
DEEPSEEK_LLM = ("[\\r\\n]", _DS_LETTERS, _DS_PUNCT, "\\s+$", _DS_CJK, r"\p{N}+")
DEEPSEEK_CODER = ("[\\r\\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DS_CJK, r"\p{N}")


@dataclass(frozen=True)
class PreTokenizer:
    name: str                  # llama.cpp's tokenizer.ggml.pre
    regexes: tuple[str, ...]   # canonical split regexes, applied in order
    ignore_merges: bool        # what llama.cpp sets for this name
    clean_spaces: bool         # llama.cpp's detokenizer clean-up (only a tie-breaker)


# Several llama.cpp names share one regex list; they differ in ignore_merges / clean_spaces.
# The first entry that fits wins, so the common name of each regex comes first.
PRE_TOKENIZERS: tuple[PreTokenizer, ...] = (
    PreTokenizer("gpt-2", (GPT2,), False, True),
    PreTokenizer("llama-bpe", (LLAMA3,), True, True),
    PreTokenizer("smaug-bpe", (LLAMA3,), False, True),
    PreTokenizer("qwen2", (QWEN2,), False, False),
    PreTokenizer("stablelm2", (QWEN2,), False, True),
    PreTokenizer("qwen35", (QWEN35,), False, False),
    PreTokenizer("gpt-4o", (GPT4O,), False, False),
    PreTokenizer("smollm", (r"\p{N}", GPT2), False, False),
    PreTokenizer("starcoder", (r"\p{N}", GPT2), False, True),
    PreTokenizer("deepseek-llm", DEEPSEEK_LLM, False, False),
    PreTokenizer("deepseek-coder", DEEPSEEK_CODER, False, False),
)

# Spellings that mean the same as a canonical regex (llama.cpp's adapted forms, which avoid `(?i:`).
_CI_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_ALIASES = {
    _GPT2_LLAMACPP: GPT2,
    LLAMA3.replace(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)", _CI_CONTRACTIONS): LLAMA3,
    QWEN2.replace(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)", _CI_CONTRACTIONS): QWEN2,
    QWEN35.replace(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)", _CI_CONTRACTIONS): QWEN35,
}


def _canonical(regex: str) -> str:
    # a literal CR/LF inside a regex means the same as the escapes \r \n
    regex = regex.replace("\r", "\\r").replace("\n", "\\n")
    return _ALIASES.get(regex, regex)


def _short(text: str, limit: int = 100) -> str:
    """Quote `text` on one line: truncated, control characters escaped, backslashes kept as they are."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return "'" + "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text) + "'"


def pre_tokenizer_regexes(pre: dict | None) -> list[str]:
    """The ordered list of split regexes a tokenizer.json `pre_tokenizer` applies, canonicalised.

    Raises BadInputError for steps llama.cpp's BPE tokenizer cannot reproduce.
    """
    if pre is None:
        raise BadInputError("tokenizer.json has no pre_tokenizer: not a byte-level BPE tokenizer")
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    regexes: list[str] = []
    byte_level = False
    for step in steps:
        kind = step.get("type")
        if kind == "Split":
            pattern = step.get("pattern") or {}
            if "Regex" not in pattern:
                raise BadInputError(f"tokenizer.json pre_tokenizer Split on a plain string {_short(str(pattern))} "
                                    "is not supported by llama.cpp")
            if step.get("behavior", "Isolated") != "Isolated" or step.get("invert", False):
                raise BadInputError(f"tokenizer.json pre_tokenizer Split with behavior={step.get('behavior')!r} "
                                    f"invert={step.get('invert')!r} is not supported by llama.cpp (needs Isolated)")
            regexes.append(_canonical(pattern["Regex"]))
        elif kind == "Digits":
            regexes.append(r"\p{N}" if step.get("individual_digits") else r"\p{N}+")
        elif kind == "ByteLevel":
            if step.get("add_prefix_space"):
                raise BadInputError("tokenizer.json ByteLevel pre_tokenizer has add_prefix_space=true, "
                                    "which llama.cpp's BPE tokenizer cannot reproduce")
            if step.get("use_regex", True):
                regexes.append(GPT2)
            byte_level = True
        else:
            raise BadInputError(f"tokenizer.json pre_tokenizer step {kind!r} is not supported by llama.cpp's "
                                "BPE tokenizer")
    if not byte_level:
        raise BadInputError("tokenizer.json pre_tokenizer has no ByteLevel step: not a byte-level BPE tokenizer")
    return regexes


def recognise_pre(pre: dict | None, ignore_merges: bool = False, clean_spaces: bool | None = None) -> str:
    """Name llama.cpp's pre-tokenizer (tokenizer.ggml.pre) for a tokenizer.json `pre_tokenizer`."""
    regexes = tuple(pre_tokenizer_regexes(pre))
    same = [p for p in PRE_TOKENIZERS if p.regexes == regexes]
    if not same:
        known = {r for p in PRE_TOKENIZERS for r in p.regexes}
        unknown = [r for r in regexes if r not in known]
        what = (f"regex {_short(unknown[0])}" if unknown
                else f"regex sequence {_short(' + '.join(regexes))}" if regexes else "(no regex)")
        raise BadInputError(f"unknown pre-tokenizer {what} in tokenizer.json: "
                            "llama.cpp has no matching tokenizer.ggml.pre")
    fits = [p for p in same if p.ignore_merges == ignore_merges]
    if not fits:
        raise BadInputError(f"tokenizer.json has ignore_merges={ignore_merges} but llama.cpp's pre-tokenizer for "
                            f"this regex ({same[0].name}) has ignore_merges={not ignore_merges}")
    if clean_spaces is not None:
        fits = [p for p in fits if p.clean_spaces == clean_spaces] or fits
    return fits[0].name


def _check_model(tj: dict) -> dict:
    model = tj.get("model") or {}
    if model.get("type", "BPE") != "BPE" or "merges" not in model:
        raise BadInputError(f"tokenizer.json model type {model.get('type')!r} is not supported (need BPE)")
    if model.get("dropout"):
        raise BadInputError(f"tokenizer.json BPE has dropout={model['dropout']}, which llama.cpp cannot reproduce")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise BadInputError(f"tokenizer.json BPE has {key}={model[key]!r}, which llama.cpp cannot reproduce")
    norm = tj.get("normalizer")
    if norm and not (norm.get("type") == "Sequence" and not norm.get("normalizers")):
        kinds = [n.get("type") for n in norm.get("normalizers", [])] if norm.get("type") == "Sequence" else []
        raise BadInputError(f"tokenizer.json normalizer {norm.get('type')!r}{kinds or ''} is not supported: "
                            "llama.cpp's BPE tokenizer does no normalization")
    return model


def merges_as_strings(merges: list) -> list[str]:
    """tokenizer.json merges ("a b" strings or ["a", "b"] pairs) -> GGUF's "a b" strings."""
    out: list[str] = []
    for m in merges:
        if isinstance(m, str):
            out.append(m)
        elif isinstance(m, (list, tuple)) and len(m) == 2 and all(isinstance(p, str) for p in m):
            # a space inside a part would split wrongly; encode it as gguf-py does (U+0120)
            out.append(" ".join(p.replace(" ", chr(ord(" ") + 256)) for p in m))
        else:
            raise BadInputError(f"tokenizer.json has a merge in an unknown format: {_short(repr(m))}")
    return out


def does_token_look_special(text: str) -> bool:
    """llama.cpp's heuristic for added tokens that ought to be control tokens."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def load_bpe(tj: dict, vocab_size: int | None, clean_spaces: bool | None = None):
    """Return (tokens, token_types, merges, pre) for a byte-level BPE tokenizer.json."""
    model = _check_model(tj)
    pre = recognise_pre(tj.get("pre_tokenizer"), bool(model.get("ignore_merges", False)), clean_spaces)
    by_id: dict[int, str] = {}
    for text, i in model.get("vocab", {}).items():
        by_id[int(i)] = text
    types: dict[int, int] = {}
    for added in tj.get("added_tokens", []):
        i, text = int(added["id"]), added["content"]
        if added.get("special") or does_token_look_special(text):
            types[i] = gguf.TokenType.CONTROL
        else:
            text = text.replace("\u2581", " ")  # as llama.cpp: pre-normalise user-defined spaces
            types[i] = gguf.TokenType.USER_DEFINED
        by_id[i] = text
    n = max(vocab_size or 0, max(by_id, default=-1) + 1)
    tokens, token_types = [], []
    for i in range(n):
        if i in by_id:
            tokens.append(by_id[i])
            token_types.append(int(types.get(i, gguf.TokenType.NORMAL)))
        else:
            tokens.append(f"[PAD{i}]")
            token_types.append(int(gguf.TokenType.UNUSED))
    return tokens, token_types, merges_as_strings(model.get("merges", [])), pre
