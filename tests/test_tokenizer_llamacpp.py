"""llama.cpp tokenizes with our GGUF vocabulary exactly as HF `tokenizers` does (reference model).

Writes a vocab-only GGUF for ../shared/models/ref-llama-27m and compares llama.cpp's ids with the HF
tokenizer's on the whole WikiText-2 raw test file. Skipped when llama_cpp is not importable.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from dsa_convert.formats.tokenizer import load_vocab, write_vocab

llama_cpp = pytest.importorskip("llama_cpp")

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"
REF_MODEL = SHARED / "models" / "ref-llama-27m"
WIKI_TEST = SHARED / "data" / "wikitext-2-raw" / "wiki.test.raw"

pytestmark = [
    pytest.mark.backend,
    pytest.mark.skipif(not (REF_MODEL / "tokenizer.json").is_file() or not WIKI_TEST.is_file(),
                       reason="reference model or WikiText-2 not present"),
]


def write_vocab_only_gguf(model_dir: Path, path: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(model_dir.name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-5))
    write_vocab(w, load_vocab(model_dir))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _llama(path: Path):
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def test_wikitext2_tokenization_matches_hf(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(REF_MODEL / "tokenizer.json"))
    gguf_path = tmp_path / "vocab.gguf"
    write_vocab_only_gguf(REF_MODEL, gguf_path)
    llm = _llama(gguf_path)
    text = WIKI_TEST.read_text(encoding="utf-8")
    hf = tok.encode(text, add_special_tokens=False).ids
    ours = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    i = _first_mismatch(ours, hf)
    assert i is None, (f"first mismatch at token {i} of {len(hf)}: llama.cpp {ours[i:i + 8]} vs HF {hf[i:i + 8]}"
                       f" (HF text {tok.decode(hf[i:i + 8])!r})")
    assert llm.token_bos() == 0 and llm.token_eos() == 1
    # add_bos is written as false (the model's TemplateProcessing is "$A"): nothing is prepended
    assert llm.tokenize(b"Hello world", add_bos=True, special=False) == tok.encode("Hello world").ids


# llama.cpp's own pre-tokenizer check text (convert_hf_to_gguf_update.py), plus a few edge cases
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f "
    "(multiple emojis concatenated) \u2705 \U0001f999\U0001f999 3 33 333 3333 33333 333333 3333333 33333333 "
    "3.3 3..3 3...3 \u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785"
    "\U0001f601 ?\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ------======= \u043d\u0435\u0449\u043e "
    "\u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438 ''''''```````\"\"\"\"......!!!!!!?????? "
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
    "   trailing spaces   \r\n\r\nCRLF\ttabs\u00a0nbsp Caf\u00e9 e\u0301 \u0130stanbul"
)


def _tiny_bpe(pre, ignore_merges: bool, text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<|bos|>", "<|eos|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _pre(name: str):
    from tokenizers import Regex, pre_tokenizers as pt

    from dsa_convert.formats.tokenizer_bpe import GPT2, LLAMA3, QWEN2

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=False)
    split = {"llama3": LLAMA3, "qwen2": QWEN2, "gpt2-split": GPT2}
    if name in split:
        return pt.Sequence([pt.Split(Regex(split[name]), behavior="isolated"), byte_level])
    if name == "digits":
        return pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False)])
    return pt.ByteLevel(add_prefix_space=False)


def _vocab_only(model_dir: Path, path: Path) -> None:
    (model_dir / "config.json").write_text(json.dumps({
        "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128, "num_attention_heads": 1}))
    write_vocab_only_gguf(model_dir, path)


@pytest.mark.parametrize("pre, ignore_merges, name", [
    ("gpt2", False, "gpt-2"), ("gpt2-split", False, "gpt-2"), ("llama3", True, "llama-bpe"),
    ("llama3", False, "smaug-bpe"), ("qwen2", False, "qwen2"), ("digits", False, "smollm"),
])
def test_tiny_bpe_tokenization_matches_hf(tmp_path, pre, ignore_merges, name):
    text = WIKI_TEST.read_text(encoding="utf-8")
    tok = _tiny_bpe(_pre(pre), ignore_merges, text[:300_000])
    tok.save(str(tmp_path / "tokenizer.json"))
    _vocab_only(tmp_path, tmp_path / "v.gguf")
    assert load_vocab(tmp_path).pre == name
    llm = _llama(tmp_path / "v.gguf")
    for sample in (CHKTXT, text[300_000:500_000]):
        hf = tok.encode(sample, add_special_tokens=False).ids
        ours = llm.tokenize(sample.encode("utf-8"), add_bos=False, special=False)
        i = _first_mismatch(ours, hf)
        assert i is None, f"{name}: first mismatch at {i}: llama.cpp {ours[i:i + 8]} vs HF {hf[i:i + 8]}"


def test_sentencepiece_tokenization_matches(tmp_path):
    import io

    import sentencepiece as spm

    text = WIKI_TEST.read_text(encoding="utf-8")
    lines = [line for line in text[:300_000].splitlines() if line.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=1000, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2, num_threads=1)
    (tmp_path / "tokenizer.model").write_bytes(buf.getvalue())
    _vocab_only(tmp_path, tmp_path / "v.gguf")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    llm = _llama(tmp_path / "v.gguf")
    for sample in [line for line in text[300_000:360_000].splitlines() if line.strip()] + [CHKTXT]:
        ours = llm.tokenize(sample.encode("utf-8"), add_bos=False, special=False)
        assert ours == sp.encode(sample), sample
