"""The needle backend of the PyTorch reference (kernels_ref): RefModel + the DsaAttention hook built as
perplexity_torch builds it, greedy generation by kernels_ref.generate.greedy_generate.

    TorchNeedleBackend(Path("m.gguf"), attn="sparse", kv="f16", tokenizer=Path("hf_dir"))

attn: dense | sparse | local | random | oracle (the sparse modes use the file's top-k, or `top_k`); kv: f32 | f16 |
q8_0 | q4_0 | asq. The model path is a GGUF or a HF checkpoint directory (dense only: no indexer). Generation stops
at EOS or at a token whose text holds a newline.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import BadInputError
from ..kernels_ref.sparse_attention import DsaAttention
from .needle_vocab import open_vocab
from .perplexity_torch import ATTN_MODES, KV_MODES, dsa_settings_from_gguf, fit_split, load_model


def resolve_device(device: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def trained_context(path: Path) -> int | None:
    """The trained context: a GGUF's {arch}.context_length, or a HF checkpoint's max_position_embeddings."""
    path = Path(path)
    if path.is_dir():
        cfg = path / "config.json"
        n = json.loads(cfg.read_text()).get("max_position_embeddings") if cfg.is_file() else None
        return int(n) if n is not None else None
    from ..formats.gguf_read import GgufFile

    g = GgufFile(path)
    try:
        n = g.get(f"{g.arch}.context_length")
        return int(n) if n is not None else None
    finally:
        g.close()


class TorchNeedleBackend:
    name = "torch"

    def __init__(self, path: Path, *, attn: str = "dense", kv: str = "f16", top_k: int | None = None,
                 tokenizer: Path | None = None, device: str = "auto", seed: int = 0, model=None, vocab=None):
        """`model` / `vocab` reuse a loaded RefModel / tokenizer (one per run, shared by the attention modes)."""
        if attn not in ATTN_MODES:
            raise BadInputError(f"unknown --attn {attn!r} for --backend torch (choose from {', '.join(ATTN_MODES)})")
        if kv not in KV_MODES:
            raise BadInputError(f"unknown --kv {kv!r} for --backend torch (choose from {', '.join(KV_MODES)})")
        if top_k is not None and top_k <= 0:
            raise BadInputError(f"--top-k must be > 0 (got {top_k})")
        self.path, self.attn, self.kv, self.seed = Path(path), attn, kv, seed
        self.model = model if model is not None else load_model(self.path, resolve_device(device))
        st = dsa_settings_from_gguf(self.model)
        self._check(st, top_k)
        self._settings = st
        self._top_k = top_k if top_k is not None else st.get("top_k")
        self._own_vocab = vocab is None
        self.vocab = vocab if vocab is not None else open_vocab(self.path, tokenizer)
        self.eos_id = int(self.vocab.eos_id)
        self.n_ctx_train = trained_context(self.path) or 0
        self._stop = {self.eos_id, *self.vocab.newline_ids()} - {-1}
        self._attention = self._hook()

    def _check(self, st: dict, top_k: int | None) -> None:
        K = top_k if top_k is not None else st.get("top_k")
        if self.attn != "dense" and not K:
            raise BadInputError(f"--attn {self.attn} needs a top-k (none in the model; pass --top-k)")
        if self.attn == "sparse" and not st.get("indexers"):
            raise BadInputError("--attn sparse needs indexer tensors (a GGUF from `dsa convert` with DSA)")
        if self.kv in ("q8_0", "q4_0") and self.model.hp.head_dim % 32:
            raise BadInputError(f"--kv {self.kv} needs head_dim divisible by 32 (model has {self.model.hp.head_dim})")
        if self.kv == "asq" and not st.get("asq_protos"):
            raise BadInputError("--kv asq needs ASQ prototypes (a GGUF from `dsa convert --cluster-num C`)")

    def _hook(self) -> DsaAttention | None:
        """The attention hook (greedy_generate runs a copy with its own cache per prompt); None: plain dense F32."""
        if self.attn == "dense" and self.kv == "f32":
            return None
        st, K = self._settings, self._top_k or 0
        S, L = st.get("sink", 0), st.get("local", 1)
        if self.attn != "dense":
            S, L = fit_split(K, S, L)
        return DsaAttention(scale=self.model.hp.kq_scale, attn=self.attn, kv=self.kv, top_k=K, sink=S, local=L,
                            select=st.get("select", "token"), block_size=st.get("block_size", 64),
                            indexers=st.get("indexers"), asq_protos=st.get("asq_protos"),
                            residual_bits=st.get("residual_bits", 4), key_space=st.get("key_space", "pre_rope"),
                            rope_keys=self.model.rope_keys, seed=self.seed, indexer_types=st.get("indexer_types"))

    def tokenize(self, text: str) -> list[int]:
        return self.vocab.tokenize(text)

    def detokenize(self, ids) -> str:
        return self.vocab.detokenize(ids)

    def generate(self, tokens: list[int], max_new: int) -> list[int]:
        from ..kernels_ref.generate import greedy_generate

        return list(greedy_generate(self.model, list(tokens), max_new, attention=self._attention, stop_ids=self._stop))

    def close(self) -> None:
        if self._own_vocab:
            self.vocab.close()
