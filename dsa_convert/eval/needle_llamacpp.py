"""Greedy generation through the patched llama.cpp for long-context retrieval tests (needle / passkey).

LlamaNeedleBackend opens one context of `n_ctx` cells (dense, sparse or local attention and the KV cache type chosen
per run with the kv overrides of perplexity_llamacpp.dsa_overrides) and answers prompts one at a time: each prompt
starts a fresh sequence, is decoded in n_batch-sized pieces with logits of its last token only, then tokens are
picked by argmax one at a time until EOS, a token whose text contains a newline, or `max_new`. The context is opened
with logits_all=False: llama-cpp-python would otherwise keep n_ctx x n_vocab floats (2 GB at 32K x 16K).

Protocol shared with the grid runner: `name`, `n_ctx_train`, `eos_id`, `tokenize(text)`, `detokenize(ids)`,
`generate(tokens, max_new)`, `close()`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..backend.llama_runner import RunnerOptions, close_model, decode_rows, open_model
from ..errors import BadInputError
from ..formats.gguf_read import GgufFile
from .perplexity_llamacpp import dsa_overrides


class LlamaNeedleBackend:
    """A GGUF in llama.cpp, generating greedily. attn: dense | sparse | local (None: as the file says); kv: f16 | f32 |
    q8_0 | q4_0 | asq; top_k / index_keys: per-run overrides as `dsa eval`; n_gpu_layers 999 offloads every layer on
    a CUDA build."""

    name = "llama.cpp"

    def __init__(self, path: Path, *, n_ctx: int, attn: str | None, kv: str = "f16", top_k: int | None = None,
                 n_gpu_layers: int = 0, threads: int | None = None, flash_attn: bool = True,
                 index_keys: str | None = None, n_batch: int = 1024):
        path = Path(path)
        if n_ctx < 8:
            raise BadInputError(f"n_ctx must be >= 8 (got {n_ctx})")
        g = GgufFile(path)
        try:
            overrides, self.mode = dsa_overrides(g, attn, top_k, kv, index_keys)
        finally:
            g.close()
        self.path, self.n_ctx, self.kv = path, n_ctx, kv
        self._llm = open_model(path, RunnerOptions(n_ctx=n_ctx, n_batch=min(n_batch, n_ctx), n_gpu_layers=n_gpu_layers,
                                                   n_threads=threads, flash_attn=flash_attn, kv_type=kv,
                                                   kv_overrides=overrides, logits_all=False))
        self.n_ctx_train = int(self._llm._model.n_ctx_train())
        self.eos_id = int(self._llm.token_eos())
        self.bos_id = int(self._llm.token_bos())
        self._newline: dict[int, bool] = {}

    def tokenize(self, text: str) -> list[int]:
        """`text` in the file's vocab after BOS (the needle formats start with BOS whether or not the vocab adds it by
        default: the reference model's README); special-token text stays plain text."""
        return [self.bos_id] + list(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def detokenize(self, ids) -> str:
        return self._llm.detokenize([int(t) for t in ids]).decode("utf-8", errors="replace")

    def _ends_line(self, tok: int) -> bool:
        if tok not in self._newline:
            self._newline[tok] = b"\n" in self._llm.detokenize([tok])
        return self._newline[tok]

    def generate(self, tokens: list[int], max_new: int) -> list[int]:
        """Greedy continuation of `tokens` as a fresh sequence: the generated ids, the line-ending token included (its
        text holds a newline), EOS not."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise BadInputError("generate: empty prompt")
        if max_new < 1:
            raise BadInputError(f"generate: max_new must be >= 1 (got {max_new})")
        if len(tokens) + max_new > self.n_ctx:
            raise BadInputError(f"prompt of {len(tokens)} tokens + {max_new} new ones exceeds the context of "
                                f"{self.n_ctx} tokens")
        logits = decode_rows(self._llm, tokens, range(len(tokens) - 1, len(tokens)))
        out: list[int] = []
        while True:
            tok = int(np.argmax(logits[0]))
            if tok == self.eos_id:
                break
            out.append(tok)
            if self._ends_line(tok) or len(out) == max_new:
                break
            logits = decode_rows(self._llm, [tok], range(0, 1), n_past=len(tokens) + len(out) - 1)
        return out

    def close(self) -> None:
        if self._llm is not None:
            close_model(self._llm)
            self._llm = None

    def __enter__(self) -> "LlamaNeedleBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
