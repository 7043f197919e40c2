"""Greedy generation with the PyTorch reference model over a KV cache (the torch side of needle / passkey tests).

One forward over the prompt fills the cache that the attention hook keeps (``DsaAttention.with_cache``: K / V after
the KV-cache round trip, indexer keys, raw keys for the oracle), then each new token is one forward of a single row
at its position. The result equals full forwards over prompt + generated tokens (same selection rules: the new row
is the last query row over all cached keys) up to float32 rounding.

    greedy_generate(model, prompt_ids, max_new=8, attention=DsaAttention(...), stop_ids={eos_id})
"""
from __future__ import annotations

import torch

from .model import RefModel
from .sparse_attention import DsaAttention


class Decoder:
    """One sequence fed incrementally through ``model``; ``feed`` returns the logits [vocab] of the last token fed.

    ``attention`` (None: dense, F32 cache) is copied with an empty cache, so the caller's hook is left untouched."""

    def __init__(self, model: RefModel, attention: DsaAttention | None = None):
        self.model = model
        self.attention = (attention if attention is not None else DsaAttention(scale=model.hp.kq_scale)).with_cache()
        self.n_past = 0

    @torch.no_grad()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        if not tokens:
            raise ValueError("feed: no tokens")
        pos = torch.arange(self.n_past, self.n_past + len(tokens))
        h = self.model.forward(torch.tensor(tokens, dtype=torch.long), attention=self.attention, positions=pos,
                               hidden=True)
        self.n_past += len(tokens)
        return self.model.head(h[-1:])[0]


def greedy_generate(model: RefModel, tokens: list[int], max_new: int, attention: DsaAttention | None = None,
                    stop_ids: set[int] | None = None) -> list[int]:
    """Greedy continuation of ``tokens``: argmax at each step (ties -> the lowest id), at most ``max_new`` tokens,
    ending early after a token in ``stop_ids`` (that token is the last one returned). Returns the generated ids."""
    if not tokens:
        raise ValueError("greedy_generate: empty prompt")
    if max_new < 0:
        raise ValueError(f"max_new must be >= 0 (got {max_new})")
    stop = stop_ids or set()
    dec = Decoder(model, attention)
    out: list[int] = []
    if max_new == 0:
        return out
    logits = dec.feed([int(t) for t in tokens])
    while True:
        nxt = int(torch.argmax(logits))          # torch returns the first maximal index
        out.append(nxt)
        if nxt in stop or len(out) == max_new:
            return out
        logits = dec.feed([nxt])
