"""`dsa eval --backend torch`: tokenise with the file's own vocab (llama.cpp vocab-only, when the
backend is installed) or a HF tokenizer dir, then kernels_ref perplexity (with ``kld``: also the KL divergence
against the dense F32 run of the same chunks)."""
from __future__ import annotations

from pathlib import Path

from ..backend.llama_runner import vocab_tokens_isolated
from ..errors import BadInputError
from ..progress import task
from .data import read_eval_text
from .perplexity_torch import load_model, perplexity_torch


def run_torch_eval(file: Path, text_path: Path, *, ctx: int, chunks: int | None, attn: str, kv: str,
                   top_k: int | None, tokenizer: Path | None, device: str, seed: int, quiet: bool,
                   kld: bool = False) -> dict:
    import torch

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    file = Path(file)
    tokens = add_bos = None
    if tokenizer is None and file.is_file():
        try:
            tokens, add_bos = vocab_tokens_isolated(file, read_eval_text(text_path))
        except Exception as e:  # backend missing: ask for the HF tokenizer instead
            raise BadInputError(f"--backend torch on a GGUF needs --tokenizer HF_DIR (or the llama.cpp backend "
                                f"for the file's own vocab): {e}") from None
    model = load_model(file, dev)
    with task("perplexity (torch)", None, quiet=quiet) as bar:
        res = perplexity_torch(file, text_path, ctx=ctx, chunks=chunks, attn=attn, kv=kv, top_k=top_k,
                               tokenizer_dir=tokenizer, tokens=tokens, add_bos=add_bos, device=dev, seed=seed,
                               model=model, progress=lambda ev: bar.advance(1, info=f"ppl {ev['ppl']:.4f}"), kld=kld)
    return res
