"""Perplexity bookkeeping shared by the torch and llama.cpp backends, following llama-perplexity
(tools/perplexity/perplexity.cpp, `perplexity()`):

* the whole file is tokenised once (BOS prepended when the vocab adds BOS);
* chunks are consecutive, non-overlapping windows of n_ctx tokens; n_chunk = n_tokens // n_ctx
  (optionally capped);
* when the vocab adds BOS, the first token of every chunk is replaced by BOS;
* only the second half of each chunk is scored: logits at positions first .. n_ctx-2 predict
  tokens first+1 .. n_ctx-1 with first = n_ctx // 2 (n_ctx - 1 - first tokens per chunk);
* log-softmax per position in double precision; PPL = exp(mean NLL);
  stderr as llama-perplexity prints it: sqrt((E[nll²] − E[nll]²) / (count − 1)) · PPL.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import BadInputError

# No torch at module level: the llama.cpp backend uses this module, and on CUDA machines a CUDA
# build of torch and llama.cpp's CUDA backend in one process crash (seen on the H200 image).


def vocab_adds_bos(model_dir: Path) -> tuple[bool, int | None]:
    """(add_bos, bos_id) of a HF checkpoint's tokenizer: tokenizer_config.add_bos_token, else the
    tokenizers post-processor template (a special token before $A)."""
    model_dir = Path(model_dir)
    cfg_p, tok_p = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    cfg = json.loads(cfg_p.read_text()) if cfg_p.is_file() else {}
    tok = json.loads(tok_p.read_text()) if tok_p.is_file() else {}
    bos_tok = cfg.get("bos_token")
    if isinstance(bos_tok, dict):
        bos_tok = bos_tok.get("content")
    bos_id = None
    for t in tok.get("added_tokens", []):
        if t.get("content") == bos_tok:
            bos_id = int(t["id"])
    if "add_bos_token" in cfg:
        return bool(cfg["add_bos_token"]) and bos_id is not None, bos_id
    pp = tok.get("post_processor") or {}
    procs = pp.get("processors", [pp]) if pp.get("type") == "Sequence" else [pp]
    for p in procs:
        if p.get("type") == "TemplateProcessing":
            single = p.get("single", [])
            if single and "SpecialToken" in single[0]:
                return True, bos_id
    return False, bos_id


def tokenize_text(text: str, tokenizer, add_bos: bool, bos_id: int | None) -> list[int]:
    """Whole-file tokenisation without special tokens, BOS prepended when add_bos."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return ([bos_id] if add_bos and bos_id is not None else []) + list(ids)


@dataclass
class ChunkPlan:
    n_ctx: int
    n_chunk: int
    first: int            # first scored logit position in a chunk (n_ctx // 2)
    add_bos: bool
    bos_id: int | None

    @property
    def tokens_scored(self) -> int:
        return self.n_chunk * (self.n_ctx - 1 - self.first)


def plan_chunks(n_tokens: int, n_ctx: int, max_chunks: int | None, add_bos: bool, bos_id: int | None) -> ChunkPlan:
    if n_ctx < 4:
        raise BadInputError(f"--ctx must be >= 4 (got {n_ctx})")
    if n_tokens < 2 * n_ctx:
        raise BadInputError(f"need at least {2 * n_ctx} tokens for ctx {n_ctx}, text has {n_tokens}")
    n_chunk = n_tokens // n_ctx
    if max_chunks is not None and max_chunks > 0:
        n_chunk = min(n_chunk, max_chunks)
    return ChunkPlan(n_ctx, n_chunk, n_ctx // 2, add_bos, bos_id)


def chunk_tokens(tokens, plan: ChunkPlan, i: int) -> np.ndarray:
    """LongTensor [n_ctx] of chunk i, first token replaced by BOS when the vocab adds BOS."""
    t = np.array(tokens[i * plan.n_ctx:(i + 1) * plan.n_ctx], dtype=np.int64)
    if plan.add_bos and plan.bos_id is not None:
        t[0] = plan.bos_id
    return t


def chunk_nll(logits, chunk, plan: ChunkPlan) -> np.ndarray:
    """Per-token NLL (float64) of the scored half: logits [n_ctx, vocab] of that chunk."""
    lg = logits[plan.first: plan.n_ctx - 1]
    if not isinstance(lg, np.ndarray):          # a torch tensor (torch backend): to host, then numpy
        lg = lg.detach().double().cpu().numpy()
    lg = np.asarray(lg, dtype=np.float64)
    tgt = np.asarray(chunk)[plan.first + 1: plan.n_ctx].astype(np.int64)
    m = lg.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(lg - m).sum(axis=-1))
    return lse - lg[np.arange(lg.shape[0]), tgt]


@dataclass
class NllAccumulator:
    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0
    per_chunk: list[float] = field(default_factory=list)

    def add(self, nlls: np.ndarray) -> None:
        self.nll += float(nlls.sum())
        self.nll2 += float((nlls ** 2).sum())
        self.count += int(nlls.size)
        self.per_chunk.append(math.exp(self.nll / self.count))   # running PPL, as printed per chunk

    def result(self) -> tuple[float, float]:
        """(ppl, ppl_stderr) as llama-perplexity's final estimate."""
        if self.count == 0:
            return float("nan"), float("nan")
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        ppl = math.exp(mean)
        err = math.sqrt(var / (self.count - 1)) * ppl if var > 0 and self.count > 1 else 0.0
        return ppl, err


def log_softmax64(logits) -> np.ndarray:
    """Row-wise log-softmax in float64 of logits [n, vocab] (numpy or torch)."""
    if not isinstance(logits, np.ndarray):
        logits = logits.detach().double().cpu().numpy()
    lg = np.asarray(logits, dtype=np.float64)
    m = lg.max(axis=-1, keepdims=True)
    return lg - (m + np.log(np.exp(lg - m).sum(axis=-1, keepdims=True)))


@dataclass
class KldAccumulator:
    """KL divergence of a run against a base run on the same tokens, as `llama-perplexity --kl-divergence` reports it
    (tools/perplexity/perplexity.cpp, `kl_divergence()`): per scored token KL(p_base ‖ p) in nats, its mean with the
    standard error, percentiles, and how often both runs rank the same token first ("same top p")."""

    kld: list[np.ndarray] = field(default_factory=list)
    same_top: int = 0
    dp: list[np.ndarray] = field(default_factory=list)   # p(target) − p_base(target), llama-perplexity's Δp

    def add(self, base_logits, logits, targets, rows_per_block: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        """Both [n, vocab] for the same n scored positions; targets [n] the next tokens. Float64 work in blocks of
        rows, so a 32K-token chunk's half (16K x vocab) never exists in float64 at once. Returns each run's
        per-token NLL of the targets (run, base), from the same log-softmax."""
        t = np.asarray(targets, dtype=np.int64)
        nll, nll_base = np.empty(t.size, np.float64), np.empty(t.size, np.float64)
        for a in range(0, t.size, rows_per_block):
            b = min(t.size, a + rows_per_block)
            lb, lq = log_softmax64(base_logits[a:b]), log_softmax64(logits[a:b])
            pb = np.exp(lb)
            self.kld.append((pb * (lb - lq)).sum(axis=-1))
            self.same_top += int((lb.argmax(-1) == lq.argmax(-1)).sum())
            rows = np.arange(b - a)
            self.dp.append(np.exp(lq[rows, t[a:b]]) - pb[rows, t[a:b]])
            nll[a:b], nll_base[a:b] = -lq[rows, t[a:b]], -lb[rows, t[a:b]]
        return nll, nll_base

    @property
    def count(self) -> int:
        return int(sum(k.size for k in self.kld))

    def result(self) -> dict:
        if not self.count:
            return {}
        k = np.concatenate(self.kld)
        dp = np.concatenate(self.dp)
        n = k.size
        top = self.same_top / n
        return {"kld_mean": float(k.mean()), "kld_stderr": float(k.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
                "kld_median": float(np.median(k)), "kld_p99": float(np.percentile(k, 99)), "kld_max": float(k.max()),
                "same_top_p": top, "same_top_p_stderr": math.sqrt(top * (1 - top) / n),
                "delta_p_mean": float(dp.mean()), "delta_p_rms": float(np.sqrt((dp ** 2).mean())), "kld_tokens": n}


def summary_lines(res: dict) -> list[str]:
    """The text form of a perplexity result (`dsa eval --ppl` without --json): PPL, the KV cache llama.cpp allocated,
    and the KL divergence figures when the run has them."""
    out = [f"PPL = {res['ppl']:.4f} +/- {res['ppl_stderr']:.5f}  ({res['backend']}, {res['device']}, "
           f"attn={res['attn']}, kv={res['kv']}, top_k={res['top_k']}, ctx={res['ctx']}, "
           f"{res['tokens']} tokens scored)"]
    if res.get("kv_bytes_per_token"):
        out.append(f"KV cache as allocated by llama.cpp: K {res['kv_k_type']} / V {res['kv_v_type']}, "
                   f"{res['kv_main_bytes'] / res['kv_cells']:.1f} B/token"
                   + (f" + {res['kv_indexer_bytes'] / res['kv_cells']:.1f} B/token indexer keys"
                      if res["kv_indexer_bytes"] else ""))
    if "ppl_base" in res:
        out.append(f"PPL of {res.get('kld_base', 'dense')} on the same tokens = {res['ppl_base']:.4f} +/- "
                   f"{res['ppl_base_stderr']:.5f} ({res['ppl_vs_base_pct']:+.2f} %)")
    if "kld_mean" in res:
        out.append(f"KLD vs {res.get('kld_base', 'dense')}: mean {res['kld_mean']:.6f} +/- {res['kld_stderr']:.6f}, "
                   f"median {res['kld_median']:.6f}, p99 {res['kld_p99']:.6f}; "
                   f"same top token {100 * res['same_top_p']:.2f} +/- {100 * res['same_top_p_stderr']:.2f} %")
    return out
