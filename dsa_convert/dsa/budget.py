"""What a retrofit recipe costs on this machine: a short measured probe of one layer at a calibration context, and the
estimate of a whole CalibPlan from it (calib.py picks the plan by this estimate and the time budget).

The probe runs the retrofit's own operations once on one chunk of random tokens: layer 0's forward as the calibration
passes run it (attention input, q/k, then the layer), the same layer under sparse attention with an untrained indexer
(the split search's forwards), the LM head and NLL of the chunk, three indexer training steps, and one k-means fit of an
ASQ head on the chunk's keys (resampled to the fit's sample count). The estimate multiplies these by the plan's counts (layers, chunks, steps, split candidates, ASQ fits); it
leaves out loading the model and reading the calibration text (measured before the plan, reported apart).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..kernels_ref.sparse_attention import DsaAttention
from .asq_fit import kmeans
from .calib import RECIPES
from .indexer_train import LayerCalib, init_indexer, train_layer
from .split import COARSE_LOCAL_FRACTIONS, COARSE_SINKS, LOCAL_FRACTIONS, SINK_CANDIDATES, head_nll_sum

# seconds the retrofit may take when --time-budget is not given: the targets for an 8K model of ~135M
# parameters (30 min on a 2-core CPU, 3 min on one GPU); a bigger model or machine states its own budget
DEFAULT_TIME_BUDGET = {"cpu": 1800.0, "cuda": 180.0}
PROBE_STEPS = 3             # indexer training steps timed (after two untimed ones)
HEAD_PROBE_SHARE = 8        # the LM head probe scores an eighth of the chunk's rows
SPLIT_FORWARDS = {"full": len(LOCAL_FRACTIONS) + len(SINK_CANDIDATES) - 1,
                  "coarse": len(COARSE_LOCAL_FRACTIONS) + len(COARSE_SINKS)}
PLACEMENT_FORWARDS = {"greedy": 9.0, "oneshot": 4.5}     # placement.py: 6 of 30 layers' worth of forwards, measured


def default_time_budget(device: str) -> float:
    return DEFAULT_TIME_BUDGET["cuda" if str(device).startswith("cuda") else "cpu"]


@dataclass
class LayerCosts:
    """Seconds measured at one calibration context on this device (per chunk of ``ctx`` tokens)."""

    ctx: int
    query_rows: int
    forward_s: float        # one layer of a calibration pass (attention input, q/k, the layer's output)
    sparse_s: float         # one layer under sparse attention (indexer scores, selection, attention)
    head_s: float           # LM head + NLL of the chunk
    step_s: float           # one indexer training step of query_rows rows
    kmeans_s: float         # one ASQ k-means fit (one KV head, one of K / V) on the full recipe's vectors
    kmeans_light_s: float   # the same on the light recipe's (calib.RECIPES)
    probe_s: float          # what the probe itself took

    def as_report(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def _sync(dev: str) -> None:
    if str(dev).startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, dev: str) -> tuple[float, object]:
    _sync(dev)
    t0 = time.perf_counter()
    out = fn()
    _sync(dev)
    return time.perf_counter() - t0, out


@torch.no_grad()
def _forward_costs(model, ctx: int, top_k: int, cfg, dev: str):
    hp = model.hp
    toks = torch.randint(hp.vocab_size, (ctx,), generator=torch.Generator().manual_seed(0))
    h = model.embed(toks).to(model.device)
    pos = torch.arange(ctx, device=model.device)

    def pass_a(hh, pp):
        x = model.attn_input(0, hh)
        q, k, _v, _kp = model.qkv(0, x, pp)
        return x, q, k, model.layer(0, hh, pp)

    # first call: loads layer 0's weights (RefModel loads them lazily); on CUDA at the full context, since the first
    # call at a size also allocates its buffers and picks its kernels, which a calibration pass pays once, not per layer
    cuda = str(dev).startswith("cuda")
    n0 = ctx if cuda else min(ctx, 16)
    pass_a(h[:n0], pos[:n0])
    model.head(h[:1])
    fwd, (x, q, k, _h1) = _timed(lambda: pass_a(h, pos), dev)
    w = init_indexer(hp.n_embd, cfg.index_heads, cfg.index_dim, cfg.rope_dim, cfg.norm_eps, hp.rope.base, 0)
    att = DsaAttention(scale=hp.kq_scale, attn="sparse", top_k=top_k, sink=min(4, top_k - 1),
                       local=max(1, top_k // 2), select=cfg.select, block_size=cfg.block_size,
                       indexers={0: w.to(torch.float32, model.device)})
    if cuda:
        model.layer(0, h, pos, attention=att)
    sparse, _ = _timed(lambda: model.layer(0, h, pos, attention=att), dev)
    n = max(1, ctx // HEAD_PROBE_SHARE)

    def head():         # as the split search scores a chunk: the LM head and log-softmax over row blocks
        return head_nll_sum(model, h[:n + 1], toks[:n + 1], 0)

    head_s, _ = _timed(head, dev)
    return fwd, sparse, head_s * ctx / n, LayerCalib(x[None], q[None], k[None], hp.kq_scale)


def probe(model, ctx: int, query_rows: int, cfg, dev: str,
          kmeans_s: tuple[float, float] | None = None) -> LayerCosts:
    """Measure LayerCosts at ``ctx`` (one chunk of random tokens through layer 0); ``kmeans_s``: reuse the k-means
    times (full, light) measured at another context (they do not depend on the context)."""
    t0 = time.perf_counter()
    fwd, sparse, head_s, data = _forward_costs(model, ctx, cfg.top_k, cfg, dev)
    hp = model.hp
    w = init_indexer(hp.n_embd, cfg.index_heads, cfg.index_dim, cfg.rope_dim, cfg.norm_eps, hp.rope.base, 0)
    kw = dict(top_k=cfg.top_k, lr=cfg.lr, query_rows=query_rows, seed=0, device=dev, phase="dense")
    w = train_layer(data, w, steps=2, **kw)                     # warm-up (imports, allocations, first-call costs)
    steps_s, _ = _timed(lambda: train_layer(data, w, steps=PROBE_STEPS, **kw), dev)
    if kmeans_s is None:
        kmeans_s = (0.0, 0.0)
        if cfg.cluster_num is not None:         # the fits' sizes, from layer 0's keys of the probe chunk
            keys = data.k[0, 0].float().cpu()
            kmeans(keys[: cfg.cluster_num * 2], cfg.cluster_num, 0)            # first call: imports, thread pools
            g = torch.Generator().manual_seed(0)
            times = []
            for div in (RECIPES["full"][2], RECIPES["light"][2]):
                n = max(cfg.cluster_num * 4, int(0.8 * cfg.asq_samples / div))     # fit_layer's training share
                idx = torch.randint(keys.shape[0], (n,), generator=g)
                x = keys[idx] + 0.01 * keys.std() * torch.randn(n, keys.shape[1], generator=g)
                t1 = time.perf_counter()
                kmeans(x, cfg.cluster_num, 0)
                times.append(time.perf_counter() - t1)
            kmeans_s = (times[0], times[1])
    del data
    return LayerCosts(ctx=ctx, query_rows=query_rows, forward_s=fwd, sparse_s=sparse, head_s=head_s,
                      step_s=steps_s / PROBE_STEPS, kmeans_s=kmeans_s[0], kmeans_light_s=kmeans_s[1],
                      probe_s=time.perf_counter() - t0)


def estimate(plan, costs: LayerCosts, *, n_layer: int, n_head_kv: int, cfg, kept_layers: int = 0) -> dict:
    """Seconds per retrofit stage for ``plan`` (a CalibPlan at costs.ctx): the same stage names as the report's
    stage_seconds, plus "total". ``kept_layers``: layers whose activations the sparse phase reuses (retrofit.py)."""
    chunks = plan.n_train + plan.n_held
    user_split = cfg.sink is not None and cfg.local is not None
    sparse_phase = not user_split and plan.sparse_steps > 0
    fwd = n_layer * chunks * costs.forward_s
    if sparse_phase:
        fwd += max(0, n_layer - kept_layers) * plan.n_train * costs.forward_s
    train = n_layer * (plan.steps + plan.sparse_steps) * costs.step_s
    eval_kl = n_layer * min(2, max(1, plan.n_held or plan.n_train)) * costs.step_s / 2
    split = 0.0
    held = plan.n_held or min(2, plan.n_train)
    if not user_split:
        sparse_fwd = held * (n_layer * costs.sparse_s + costs.head_s)
        split = SPLIT_FORWARDS[plan.split_search] * sparse_fwd
        if plan.split_search == "full":
            split += held * (n_layer * costs.forward_s + costs.head_s)          # the dense reference NLL
    place = 0.0
    if cfg.index_share > 1 and cfg.index_place == "search":
        place = PLACEMENT_FORWARDS[plan.placement_search] * held * (n_layer * costs.sparse_s + costs.head_s)
    spaces = 2 if cfg.key_space == "auto" else 1
    fit_s = costs.kmeans_s if plan.asq_div == RECIPES["full"][2] else costs.kmeans_light_s
    asq = n_layer * n_head_kv * (spaces + 1) * fit_s if cfg.cluster_num is not None else 0.0
    out = {"calib_forward": fwd, "train": train, "eval_kl": eval_kl, "split": split, "asq_fit": asq}
    if place:
        out["placement"] = place
    out = {k: round(v, 1) for k, v in out.items()}
    out["total"] = round(sum(out.values()), 1)
    return out
