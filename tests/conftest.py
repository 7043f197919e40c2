"""Shared fixtures: tiny random HF checkpoints of each supported architecture, generated here."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DSA_SHARED", REPO.parent / "shared"))
REF_MODEL = SHARED / "models" / "ref-llama-27m"
WIKI_RAW = SHARED / "data" / "wikitext-2-raw" / "wiki.test.raw"
CALIB = SHARED / "data" / "calib" / "books-calib.txt"

torch.set_num_threads(min(2, os.cpu_count() or 1))

_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Robert Boulter is an English film, television and theatre actor.",
    "In 2000 he had a guest role in the television series The Bill; 1,234 numbers 56789.",
    "Valkyria Chronicles III is a tactical role @-@ playing video game developed by Sega.",
]


def wiki_passage(n_chars: int = 3000) -> str:
    if WIKI_RAW.is_file():
        return WIKI_RAW.read_text(encoding="utf-8")[:n_chars]
    return " ".join(_TOKENIZER_TEXT * 40)[:n_chars]


def make_bpe_tokenizer(out: Path, vocab_size: int = 320) -> None:
    """A real byte-level BPE tokenizer.json (GPT-2 pre-tokenization) trained on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TOKENIZER_TEXT * 20 + [wiki_passage(20000)], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "add_bos_token": True,
         "tokenizer_class": "PreTrainedTokenizerFast"}))


# name -> (transformers config class, kwargs, post-edit of config.json, shard size)
VARIANTS = {
    "llama-llama3rope-tied-sharded": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, rope_theta=500000.0), "legacy", "200KB"),
    "llama-linear-bias-headdim": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, attention_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0}), "legacy", None),
    "mistral-gqa": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None,
                                          rope_theta=1000000.0), "v5", None),
    "qwen2-yarn-tied": ("Qwen2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}), "legacy", "300KB"),
    "qwen3-qknorm-headdim": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                 tie_word_embeddings=False), "v5", None),
}


def make_tiny_model(out: Path, variant: str, seed: int = 0, n_layer: int = 2) -> Path:
    import transformers

    cls_name, kw, style, shard = VARIANTS[variant]
    out.mkdir(parents=True, exist_ok=True)
    make_bpe_tokenizer(out)
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layer,
                max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    base.update({k: v for k, v in kw.items() if k not in ("rope_scaling", "rope_theta")})
    rope = dict(kw.get("rope_scaling") or {"rope_type": "default"})
    rope["rope_theta"] = kw.get("rope_theta", 10000.0)
    cfg = getattr(transformers, cls_name)(**base, rope_parameters=rope)
    cfg.architectures = [cls_name.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = getattr(transformers, cfg.architectures[0])(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases so that every tensor matters
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(out, max_shard_size=shard or "50GB")
    if style == "legacy":  # older checkpoints: rope_theta / rope_scaling instead of rope_parameters
        c = json.loads((out / "config.json").read_text())
        rp = c.pop("rope_parameters", {})
        c["rope_theta"] = rp.pop("rope_theta", 10000.0)
        if rp.get("rope_type", "default") != "default":
            c["rope_scaling"] = rp
        (out / "config.json").write_text(json.dumps(c, indent=2))
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {v: make_tiny_model(root / v, v) for v in VARIANTS}


@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    return make_tiny_model(tmp_path / "m", "llama-llama3rope-tied-sharded")


def hf_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(tokens[None]).logits[0]


def hf_tokens(model_dir: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def needs(path: Path):
    return pytest.mark.skipif(not path.exists(), reason=f"{path} not present")


def have_backend() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except Exception:
        return False


_skip_no_backend = pytest.mark.skipif(not have_backend() and not os.environ.get("DSA_REQUIRE_BACKEND"),
                                      reason="llama.cpp backend not built (dsa backend build)")


def requires_backend(fn):
    """Marks a test `backend` (run after the backend build in scripts/test.sh) and skips it when the
    backend is absent — except under DSA_REQUIRE_BACKEND=1 (CI), where a missing backend fails."""
    return pytest.mark.backend(_skip_no_backend(fn))
__all__ = ["shutil"]


def verify_module():
    """scripts/verify_dsa_patch.py as a module: its llama.cpp / kernels_ref logit helpers."""
    spec = importlib.util.spec_from_file_location("verify_dsa_patch", REPO / "scripts" / "verify_dsa_patch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dsa_eval_json(*args) -> dict:
    """`dsa eval ARGS --json` in a child process; it must succeed."""
    r = subprocess.run([sys.executable, "-m", "dsa_convert.cli", "eval", *args, "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
