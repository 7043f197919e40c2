"""Tests for dsa_convert.formats.tokenizer (HF tokenizer -> GGUF vocabulary)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from dsa_convert.errors import BadInputError
from dsa_convert.formats.tokenizer import VocabSpec, load_vocab, write_vocab
from dsa_convert.formats.tokenizer_bpe import GPT2, LLAMA3, QWEN2, recognise_pre

REF_MODEL = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "ref-llama-27m"
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 2024, isn't it?",
    "Hello world!  This is a tiny test corpus, with 12345 numbers and some   spaces.",
    "Tokenizers split text into pieces; BPE merges the most frequent pairs first.",
    "Ünïcödé text, 日本語のテキスト, and emoji 🦙 are here too.\n\nNew paragraph\tand tab.",
] * 5
T = gguf.TokenType


def _write(d: Path, name: str, data) -> None:
    (d / name).write_text(json.dumps(data), encoding="utf-8")


def _bpe_dir(tmp: Path, pre, *, ignore_merges=False, normalizer=None, post=None,
             added=(), config=None, tok_config=None, size=400) -> Path:
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    if post is not None:
        tok.post_processor = post
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    if added:
        tok.add_tokens(list(added))
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    _write(tmp, "config.json", config if config is not None else {"vocab_size": size})
    _write(tmp, "tokenizer_config.json", tok_config if tok_config is not None
           else {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"})
    return tmp


def _split(regex: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


GPT2_PRE = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# ---------------------------------------------------------------- byte-level BPE

def test_gpt2_byte_level(tmp_path):
    d = _bpe_dir(tmp_path, GPT2_PRE, added=["<think>"], config={"vocab_size": 420})
    tj = json.loads((d / "tokenizer.json").read_text())
    v = load_vocab(d)
    assert (v.model, v.pre) == ("gpt2", "gpt-2")
    assert v.scores is None
    assert v.vocab_size == 420                              # config vocab_size > tokenizer ids
    assert v.tokens[:3] == SPECIALS and v.token_types[:3] == [T.CONTROL] * 3
    for text, i in tj["model"]["vocab"].items():
        assert v.tokens[i] == text
        if text not in SPECIALS:
            assert v.token_types[i] == T.NORMAL
    think = v.tokens.index("<think>")
    assert think == 400 and v.token_types[think] == T.USER_DEFINED
    assert v.tokens[401:] == [f"[PAD{i}]" for i in range(401, 420)]
    assert set(v.token_types[401:]) == {T.UNUSED}
    assert v.merges == [" ".join(m) for m in tj["model"]["merges"]]
    assert all(len(m.split(" ")) == 2 for m in v.merges)
    assert (v.bos_id, v.eos_id, v.pad_id, v.unk_id) == (0, 1, 2, None)
    assert (v.add_bos, v.add_eos) == (None, None)          # no post_processor, no flags
    assert v.chat_template is None


def test_vocab_size_argument_and_tokenizer_larger_than_config(tmp_path):
    d = _bpe_dir(tmp_path, GPT2_PRE, config={"vocab_size": 100})
    assert load_vocab(d).vocab_size == 400                  # max(config, tokenizer)
    assert load_vocab(d, vocab_size=512).vocab_size == 512


def test_merges_string_form_equals_list_form(tmp_path):
    d = _bpe_dir(tmp_path, GPT2_PRE)
    listed = load_vocab(d)
    tj = json.loads((d / "tokenizer.json").read_text())
    assert isinstance(tj["model"]["merges"][0], list)
    tj["model"]["merges"] = [" ".join(m) for m in tj["model"]["merges"]]
    _write(d, "tokenizer.json", tj)
    assert load_vocab(d).merges == listed.merges


@pytest.mark.parametrize("pre, ignore_merges, name", [
    (_split(LLAMA3), True, "llama-bpe"),
    (_split(LLAMA3), False, "smaug-bpe"),
    (_split(QWEN2), False, "qwen2"),
    (_split(GPT2), False, "gpt-2"),
    (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), GPT2_PRE]), False, "smollm"),
])
def test_pre_tokenizer_recognised_from_regex(tmp_path, pre, ignore_merges, name):
    d = _bpe_dir(tmp_path, pre, ignore_merges=ignore_merges)
    assert load_vocab(d).pre == name


def test_llamacpp_adapted_regex_spelling_is_recognised():
    adapted = LLAMA3.replace(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
                             r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])")
    pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": adapted}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    assert recognise_pre(pre, ignore_merges=True) == "llama-bpe"


def test_qwen2_regex_with_clean_spaces_picks_stablelm2():
    pre = json.loads(_split(QWEN2).__getstate__())
    assert recognise_pre(pre, False, clean_spaces=True) == "stablelm2"
    assert recognise_pre(pre, False, clean_spaces=False) == "qwen2"
    assert recognise_pre(pre, False) == "qwen2"


def test_unknown_regex_is_rejected_naming_it(tmp_path):
    regex = r"\p{L}+|\p{N}{1,5}|[^\s\p{L}\p{N}]+|\s+"
    d = _bpe_dir(tmp_path, _split(regex))
    with pytest.raises(BadInputError) as e:
        load_vocab(d)
    msg = str(e.value)
    assert "\n" not in msg and "unknown pre-tokenizer" in msg and f"'{regex}'" in msg
    assert e.value.exit_code == 3


def test_unknown_long_regex_is_truncated():
    regex = "(" + "|".join(f"word{i}" for i in range(100)) + ")"
    pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
    with pytest.raises(BadInputError, match=r"'\(word0\|word1.*\.\.\.'") as e:
        recognise_pre(pre)
    assert len(str(e.value)) < 250


def test_qwen2_regex_with_ignore_merges_is_rejected():
    pre = json.loads(_split(QWEN2).__getstate__())
    with pytest.raises(BadInputError, match="ignore_merges"):
        recognise_pre(pre, ignore_merges=True)


@pytest.mark.parametrize("pre, match", [
    (pre_tokenizers.ByteLevel(add_prefix_space=True), "add_prefix_space"),
    (pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), GPT2_PRE]), "Whitespace"),
    (pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GPT2), behavior="removed"), GPT2_PRE]), "Isolated"),
])
def test_unrepresentable_pre_tokenizers_are_rejected(tmp_path, pre, match):
    d = _bpe_dir(tmp_path, pre)
    with pytest.raises(BadInputError, match=match):
        load_vocab(d)


def test_normalizer_is_rejected(tmp_path):
    d = _bpe_dir(tmp_path, GPT2_PRE, normalizer=normalizers.NFC())
    with pytest.raises(BadInputError, match="normalizer 'NFC'"):
        load_vocab(d)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["normalizer"] = {"type": "Sequence", "normalizers": []}     # an empty sequence is fine
    _write(d, "tokenizer.json", tj)
    assert load_vocab(d).pre == "gpt-2"


def test_special_ids_and_add_bos_from_template(tmp_path):
    post = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                         special_tokens=[("<|bos|>", 0)])
    d = _bpe_dir(tmp_path, _split(LLAMA3), ignore_merges=True, post=post,
                 config={"vocab_size": 400, "eos_token_id": [1, 2]},
                 tok_config={"bos_token": {"content": "<|bos|>"}, "add_eos_token": False,
                             "chat_template": "{{ messages }}"})
    _write(d, "generation_config.json", {"pad_token_id": 2, "eos_token_id": 3})
    v = load_vocab(d)
    assert (v.bos_id, v.eos_id, v.pad_id) == (0, 1, 2)   # tokenizer_config, config.json (first), generation
    assert (v.add_bos, v.add_eos) == (True, False)
    assert v.chat_template == "{{ messages }}"


def test_add_flags_from_tokenizer_config_and_chat_template_file(tmp_path):
    d = _bpe_dir(tmp_path, GPT2_PRE, tok_config={"eos_token": "<|eos|>", "add_bos_token": True})
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m }}{% endfor %}")
    v = load_vocab(d)
    assert (v.bos_id, v.eos_id, v.add_bos, v.add_eos) == (None, 1, True, None)
    assert v.chat_template.startswith("{% for m")


def test_plain_template_means_no_bos_no_eos(tmp_path):
    post = processors.TemplateProcessing(single="$A", pair="$A $B", special_tokens=[])
    v = load_vocab(_bpe_dir(tmp_path, GPT2_PRE, post=post))
    assert (v.add_bos, v.add_eos) == (False, False)


def test_no_tokenizer(tmp_path):
    _write(tmp_path, "config.json", {"vocab_size": 10})
    with pytest.raises(BadInputError) as e:
        load_vocab(tmp_path)
    assert str(e.value) == f"no tokenizer found in {tmp_path} (expected tokenizer.json or tokenizer.model)"


def test_sentencepiece_style_tokenizer_json_without_model(tmp_path):
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=200, show_progress=False,
                                                      special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(BadInputError, match="no tokenizer.model"):
        load_vocab(tmp_path)


def test_write_vocab_roundtrip(tmp_path):
    post = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    v = load_vocab(_bpe_dir(tmp_path / "m", GPT2_PRE, post=post, tok_config={
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "chat_template": "x"}))
    r = _write_and_read(tmp_path / "v.gguf", v)
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.pre") == "gpt-2"
    assert _field(r, "tokenizer.ggml.tokens") == v.tokens
    assert _field(r, "tokenizer.ggml.token_type") == v.token_types
    assert _field(r, "tokenizer.ggml.merges") == v.merges
    assert _field(r, "tokenizer.ggml.bos_token_id") == 0
    assert _field(r, "tokenizer.ggml.eos_token_id") == 1
    assert _field(r, "tokenizer.ggml.padding_token_id") == 2
    assert _field(r, "tokenizer.ggml.add_bos_token") is True
    assert _field(r, "tokenizer.ggml.add_eos_token") is False
    assert _field(r, "tokenizer.chat_template") == "x"
    assert r.get_field("tokenizer.ggml.scores") is None
    assert r.get_field("tokenizer.ggml.unknown_token_id") is None


def _write_and_read(path: Path, v: VocabSpec) -> gguf.GGUFReader:
    w = gguf.GGUFWriter(path, "llama")
    write_vocab(w, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(path)


def _field(r: gguf.GGUFReader, key: str):
    f = r.get_field(key)
    assert f is not None, key
    return f.contents()


# ---------------------------------------------------------------- SentencePiece

SPM_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny test corpus for sentencepiece.",
    "Numbers 123 and 4567 appear here, too.",
    "Another line with some more words: tokenizer, vocabulary, merges.",
] * 20


def _spm_dir(tmp: Path, *, config=None, tok_config=None, **train) -> Path:
    import sentencepiece as spm

    opts = dict(model_type="bpe", vocab_size=360, byte_fallback=True, normalization_rule_name="identity",
                remove_extra_whitespaces=False, hard_vocab_limit=False, user_defined_symbols=["<sep>"],
                minloglevel=2)
    opts.update(train)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(SPM_LINES), model_writer=buf, **opts)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer.model").write_bytes(buf.getvalue())
    if config is not None:
        _write(tmp, "config.json", config)
    if tok_config is not None:
        _write(tmp, "tokenizer_config.json", tok_config)
    return tmp


def test_sentencepiece_llama_vocab(tmp_path):
    import sentencepiece as spm

    d = _spm_dir(tmp_path, config={"vocab_size": 364, "bos_token_id": 1, "eos_token_id": 2},
                 tok_config={"add_bos_token": True, "add_eos_token": False,
                             "added_tokens_decoder": {"362": {"content": "<|im_end|>", "special": True}}})
    _write(d, "added_tokens.json", {"<extra>": 361})
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    n = sp.vocab_size()
    assert n == 360
    v = load_vocab(d)
    assert (v.model, v.pre, v.vocab_size, v.merges) == ("llama", "default", 364, [])
    assert v.tokens[:4] == ["<unk>", "<s>", "</s>", "<sep>"]
    assert v.token_types[:4] == [T.UNKNOWN, T.CONTROL, T.CONTROL, T.USER_DEFINED]
    assert v.tokens[4:260] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(v.token_types[4:260]) == {T.BYTE}
    assert v.tokens[260:n] == [sp.id_to_piece(i) for i in range(260, n)]
    assert set(v.token_types[260:n]) == {T.NORMAL}
    assert v.scores[:n] == pytest.approx([sp.get_score(i) for i in range(n)])
    assert any(t.startswith("\u2581") and len(t) > 2 for t in v.tokens[260:n])    # SentencePiece's own text
    assert (v.tokens[360], v.token_types[360], v.scores[360]) == ("[PAD360]", T.UNUSED, -10000.0)
    assert (v.tokens[361], v.token_types[361], v.scores[361]) == ("<extra>", T.USER_DEFINED, -1000.0)
    assert (v.tokens[362], v.token_types[362]) == ("<|im_end|>", T.CONTROL)
    assert (v.bos_id, v.eos_id, v.unk_id, v.pad_id) == (1, 2, 0, None)
    assert (v.add_bos, v.add_eos, v.add_space_prefix) == (True, False, None)
    r = _write_and_read(tmp_path / "v.gguf", v)
    assert _field(r, "tokenizer.ggml.model") == "llama"
    assert _field(r, "tokenizer.ggml.scores") == pytest.approx(v.scores)
    assert _field(r, "tokenizer.ggml.token_type") == v.token_types
    assert r.get_field("tokenizer.ggml.merges") is None


def test_sentencepiece_ids_from_model_without_configs(tmp_path):
    v = load_vocab(_spm_dir(tmp_path, add_dummy_prefix=False))
    assert v.vocab_size == 360
    assert (v.bos_id, v.eos_id, v.unk_id, v.pad_id) == (1, 2, 0, None)
    assert (v.add_bos, v.add_eos, v.add_space_prefix) == (None, None, False)


@pytest.mark.parametrize("train, match", [
    ({"normalization_rule_name": "nmt_nfkc"}, "normalization 'nmt_nfkc'"),
    ({"remove_extra_whitespaces": True}, "remove_extra_whitespaces"),
    ({"model_type": "unigram"}, "unigram"),
    ({"treat_whitespace_as_suffix": True}, "treat_whitespace_as_suffix"),
])
def test_sentencepiece_unsupported_settings(tmp_path, train, match):
    with pytest.raises(BadInputError, match=match):
        load_vocab(_spm_dir(tmp_path, **train))


def test_corrupt_sentencepiece_model(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\xff\xff")
    with pytest.raises(BadInputError, match="not a valid SentencePiece model"):
        load_vocab(tmp_path)


# ---------------------------------------------------------------- reference model

@pytest.mark.skipif(not (REF_MODEL / "tokenizer.json").is_file(), reason="reference model not present")
def test_reference_model():
    v = load_vocab(REF_MODEL)
    assert (v.model, v.pre) == ("gpt2", "gpt-2")          # README: GPT-2 pre-tokenization
    assert v.vocab_size == 16384 and len(v.token_types) == 16384
    assert (v.bos_id, v.eos_id, v.pad_id) == (0, 1, 2)
    assert v.tokens[:3] == ["<|bos|>", "<|eos|>", "<|pad|>"]
    assert v.token_types[:3] == [T.CONTROL] * 3 and set(v.token_types[3:]) == {T.NORMAL}
    assert (v.add_bos, v.add_eos) == (False, False)      # its TemplateProcessing is just "$A"
    tj = json.loads((REF_MODEL / "tokenizer.json").read_text(encoding="utf-8"))
    assert len(v.merges) == len(tj["model"]["merges"]) and v.merges[0] == " ".join(tj["model"]["merges"][0])
