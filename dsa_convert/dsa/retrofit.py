"""DSA retrofit of a HF Llama-family checkpoint: indexer distillation, sink/local split, ASQ fit.

    res = run_retrofit(Path("model_dir"), DsaConfig(top_k=512, calib=Path("calib.txt")))
    res.kv       {"llama.attention.indexer.top_k": (512, GGUFValueType.UINT32), ...}
    res.tensors  {"blk.0.indexer.attn_qkw.weight": np.ndarray [H*D + D + H, n_embd], ...}  (gguf-py order)
    res.report   measured numbers (losses, split candidates, ASQ errors, timings)

With ``cfg.index_share`` G > 1 only ceil(n_layer / G) layers keep an indexer; the others reuse the top-k of the
last full layer before them (FORMAT §4a). ``index_place="search"`` (the default) trains an indexer in every layer
on its own target, as for G = 1, then picks the full layers by held-out calibration NLL (placement.py: greedy, or
one-shot in the CPU's long-context recipe);
``"every"`` fixes them at 0, G, 2G, ..., each trained on the mean target of its group (the layer and its shared
layers).

The main model is frozen and run with the reference forward (kernels_ref.model.RefModel), one layer
at a time over all calibration chunks, each layer once per pass (a group's shared layers in the same
forward that collects their q/k); the hidden states and the current group's x/q/k stay on the
training device (on a GPU this avoids a host-to-device copy per training step). The sparse phase after the split search
reuses the first pass's attention inputs x of the layers the memory budget holds (from layer 0; their q and k are
projected from x again, the same values) instead of a second pass over the model (on a 2-core CPU at 32K that pass is
most of the phase), and runs the frozen model only from the first layer not kept. K prototypes are in
the GGUF's head layout (llama q/k rows are permuted to GGML's interleaved RoPE), as the llama.cpp KV
cache holds them.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from gguf import GGUFValueType

from ..errors import BadInputError
from ..formats import indexer_layout
from ..kernels_ref.indexer import IndexerWeights
from ..resources import peak_rss_mib
from .asq_fit import AsqSampler, LayerAsq, choose_key_space, fit_layer
from .budget import default_time_budget, estimate, probe
from .calib import activation_bytes_per_token, calib_chunks, plan_calibration
from .config import DsaConfig
from .indexer_train import LayerCalib, TrainLog, eval_kl, init_indexer, train_layer
from .placement import choose_full_layers, n_full_layers
from .split import choose_split

ProgressFn = Callable[[dict], None]
FORMAT_VERSION = 1


@dataclass
class DsaResult:
    arch: str
    kv: dict[str, tuple[object, GGUFValueType]] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    report: dict = field(default_factory=dict)

    # ---- in-memory access for the torch evaluator
    def indexers(self) -> dict[int, IndexerWeights]:
        out = {}
        rope_dim = int(self.kv[f"{self.arch}.dsa.indexer.rope_dim"][0])
        eps = float(self.kv[f"{self.arch}.dsa.indexer.norm_eps"][0])
        base = float(self.report["freq_base"])
        H = int(self.kv[f"{self.arch}.attention.indexer.head_count"][0])
        D = int(self.kv[f"{self.arch}.attention.indexer.key_length"][0])
        has = self.tensors.__contains__
        get = lambda n: torch.from_numpy(self.tensors[n])  # noqa: E731
        for name in self.tensors:
            if name.endswith(".indexer.k_norm.weight"):
                il = int(name.split(".")[1])
                W_q, W_k, W_w = indexer_layout.projections(has, get, il, H, D)
                p = indexer_layout.prefix(il)
                out[il] = IndexerWeights(W_q, W_k, get(p + "k_norm.weight"), get(p + "k_norm.bias"), W_w,
                                         rope_dim, eps, base)
        return out

    def indexer_types(self) -> list[bool] | None:
        v = self.kv.get(f"{self.arch}.attention.indexer.types")
        return None if v is None else [bool(x) for x in v[0]]

    def asq_protos(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for name in self.tensors:
            if name.endswith(".dsa.asq_k_proto"):
                il = int(name.split(".")[1])
                out[il] = (torch.from_numpy(self.tensors[name]),
                           torch.from_numpy(self.tensors[f"blk.{il}.dsa.asq_v_proto"]))
        return out

    def setting(self, key: str, default=None):
        v = self.kv.get(f"{self.arch}.{key}")
        return default if v is None else v[0]


def dsa_kv(arch: str, cfg: DsaConfig, sink: int, local: int, split_source: str, key_space: str | None,
           types: list[bool] | None = None) -> dict:
    U, F, S = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    kv = {
        f"{arch}.attention.indexer.head_count": (cfg.index_heads, U),
        f"{arch}.attention.indexer.key_length": (cfg.index_dim, U),
        f"{arch}.attention.indexer.top_k": (cfg.top_k, U),
        f"{arch}.dsa.version": (FORMAT_VERSION, U),
        f"{arch}.dsa.sink": (sink, U),
        f"{arch}.dsa.local": (local, U),
        f"{arch}.dsa.select": (cfg.select, S),
        f"{arch}.dsa.block_size": (cfg.block_size, U),
        f"{arch}.dsa.indexer.rope_dim": (cfg.rope_dim, U),
        f"{arch}.dsa.indexer.norm_eps": (cfg.norm_eps, F),
        f"{arch}.dsa.split_source": (split_source, S),
    }
    if types is not None and not all(types):
        # upstream's key (GLM-5.2's IndexCache layers): written only when some layer reuses another's top-k
        kv[f"{arch}.attention.indexer.types"] = ([bool(t) for t in types], GGUFValueType.ARRAY)
    if cfg.cluster_num is not None:
        kv[f"{arch}.dsa.asq.cluster_num"] = (cfg.cluster_num, U)
        kv[f"{arch}.dsa.asq.residual_bits"] = (cfg.residual_bits, U)
        kv[f"{arch}.dsa.asq.key_space"] = (key_space, S)
    return kv


def indexer_tensors(il: int, w: IndexerWeights) -> dict[str, np.ndarray]:
    f = lambda t: np.ascontiguousarray(t.detach().float().cpu().numpy())  # noqa: E731
    p = f"blk.{il}.indexer."
    # q_b, k and proj stacked in one matrix (FORMAT.md §3): the runtime computes the three with one product
    return {p + indexer_layout.QKW: indexer_layout.stack(f(w.W_q), f(w.W_k), f(w.W_w)),
            p + "k_norm.weight": f(w.gamma), p + "k_norm.bias": f(w.beta)}


def _model_ctx(model, cfg: DsaConfig | None = None) -> int:
    """The model's context: the most the calibration context may be. A HF config without max_position_embeddings
    leaves it unknown: then --calib-ctx must say it (one line, before any work)."""
    spec = getattr(model, "spec", None)
    extra = getattr(spec, "extra", None) or {}
    if cfg is not None and cfg.ctx is None and "max_position_embeddings" in extra \
            and extra["max_position_embeddings"] is None:
        raise BadInputError(f"{spec.name}: config.json has no 'max_position_embeddings', so the retrofit cannot "
                            "choose a calibration context; pass --calib-ctx")
    for a in ("n_ctx", "context_length", "n_ctx_train", "max_position_embeddings"):
        if spec is not None and getattr(spec, a, None):
            return int(getattr(spec, a))
    return 2048


def _layer_data(model, il: int, h: torch.Tensor, pos: torch.Tensor, sampler: AsqSampler | None):
    xs, qs, ks = [], [], []
    with torch.no_grad():
        for hh in h:
            x = model.attn_input(il, hh.to(model.device))
            q, k, v, k_pre = model.qkv(il, x, pos)
            if sampler is not None:
                sampler.add(k_pre, k, v, pos)
            xs.append(x), qs.append(q), ks.append(k)
    return torch.stack(xs), torch.stack(qs), torch.stack(ks)


def _advance(model, il: int, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model.layer(il, hh.to(model.device), pos) for hh in h])


def _groups(types: list[bool]):
    """(il, end) per group, in layer order: full layer il and the shared layers il + 1 .. end - 1 after it (FORMAT.md
    §4a; types[0] is full, so every layer is in one group)."""
    starts = [il for il, full in enumerate(types) if full] + [len(types)]
    return zip(starts, starts[1:])


def _group_pass(model, il: int, end: int, h: torch.Tensor, pos: torch.Tensor, n_train: int,
                samplers: dict[int, AsqSampler]) -> tuple[LayerCalib, LayerCalib | None, torch.Tensor]:
    """Layers il .. end - 1 (full layer il and its shared layers) in one forward over the chunks of h: the calibration
    data of the first n_train chunks (layer il's x, q, k; the shared layers' q, k as members: they distil into il's
    indexer), of the other chunks when h has more (held-out; else None), ASQ samples of the first n_train chunks
    (samplers: layer -> AsqSampler) and h advanced past the group (not past the model's last layer: nothing reads it).
    Each layer's forward runs once."""
    train = held = None
    for j in range(il, end):
        x, q, k = _layer_data(model, j, h[:n_train], pos, samplers.get(j))
        hx = _layer_data(model, j, h[n_train:], pos, None) if h.shape[0] > n_train else None
        if j == il:
            train = LayerCalib(x, q, k, model.hp.kq_scale)
            held = LayerCalib(*hx, model.hp.kq_scale) if hx is not None else None
        else:
            train.members.append((q, k))
            if held is not None:
                held.members.append(hx[1:])
        del x, hx
        if j + 1 < model.hp.n_layer:
            h = _advance(model, j, h, pos)
    return train, held, h


def _group_bytes(hp, plan, members: int) -> int:
    """float32 bytes of one group's training activations (x of its full layer, q / k of its ``members`` layers)."""
    return 4 * plan.n_train * plan.ctx * (hp.n_embd + members * (hp.n_head + hp.n_head_kv) * hp.head_dim)


def _kept_bytes(hp, plan, members: int) -> int:
    """float32 bytes the sparse phase keeps of one group (_keep): x of its full layer and q / k of its shared layers
    (SmolLM2: x is 576 of the 1,344 floats a token has in x, q and k)."""
    return 4 * plan.n_train * plan.ctx * (hp.n_embd + (members - 1) * (hp.n_head + hp.n_head_kv) * hp.head_dim)


def _keep(data: LayerCalib) -> LayerCalib:
    """What the sparse phase keeps of a group's first-pass data: the full layer's q and k are dropped (_unkeep projects
    them from x again: the same values, as the first pass computed them from the same x)."""
    return LayerCalib(data.x, None, None, data.scale, data.members)


def _unkeep(model, il: int, kept: LayerCalib, pos: torch.Tensor) -> LayerCalib:
    """The group's training data from what _keep kept: layer il's q and k from its x, chunk by chunk as in the first
    pass (model.qkv on each chunk's x)."""
    qs, ks = [], []
    with torch.no_grad():
        for x in kept.x:
            q, k, _v, _kp = model.qkv(il, x, pos)
            qs.append(q), ks.append(k)
    return LayerCalib(kept.x, torch.stack(qs), torch.stack(ks), kept.scale, kept.members)


def _keeps_pass_a_data(hp, types: list[bool], plan, dev: str) -> int:
    """Bytes of the first pass's training activations that the sparse phase may reuse instead of running the frozen
    model over the calibration chunks a second time (the same values: each chunk's forward is independent): what the
    plan's memory budget leaves beside its working set (0: recompute every layer). The groups are kept in layer order
    while they fit; the pass B forward restarts from the hidden state at the first group not kept."""
    working = (plan.n_train + plan.n_held) * plan.ctx * plan.bytes_per_token
    return max(0, plan.memory_budget - working)


def _kept_layers(hp, types: list[bool], plan, keep_bytes: int) -> int:
    """How many layers' data (_keep) fit ``keep_bytes`` (the groups in layer order)."""
    used, n = 0, 0
    for il, end in _groups(types):
        used += _kept_bytes(hp, plan, end - il)
        if used > keep_bytes:
            break
        n = end
    return n


def _planned(model, cfg: DsaConfig, dev: str, group: int, types_for_keep):
    """The CalibPlan for this model and config: the time budget (cfg's, else the device's default) decides the context
    and recipe by a probe of this machine's speed at each context tried (budget.py)."""
    hp = model.hp
    model_ctx = _model_ctx(model, cfg)
    if cfg.ctx is None and cfg.top_k >= model_ctx:
        raise BadInputError(f"--top-k {cfg.top_k} must be smaller than the model's context {model_ctx}")
    budget = default_time_budget(dev) if cfg.time_budget is None else (cfg.time_budget or None)
    probes: dict[tuple[int, int], object] = {}

    def estimator(plan) -> dict:
        key = (plan.ctx, plan.query_rows)
        if key not in probes:
            km = next(((c.kmeans_s, c.kmeans_light_s) for c in probes.values()), None)
            probes[key] = probe(model, plan.ctx, plan.query_rows, cfg, dev, kmeans_s=km)
        keep = _kept_layers(hp, types_for_keep, plan, _keeps_pass_a_data(hp, types_for_keep, plan, dev))
        return estimate(plan, probes[key], n_layer=hp.n_layer, n_head_kv=hp.n_head_kv, cfg=cfg, kept_layers=keep)

    plan = plan_calibration(ctx=cfg.ctx, calib_tokens=cfg.calib_tokens, calib_chunks=cfg.calib_chunks,
                            split_chunks=cfg.split_chunks, model_ctx=model_ctx, device=dev,
                            bytes_per_token=activation_bytes_per_token(hp.n_embd, hp.n_head, hp.n_head_kv,
                                                                       hp.head_dim, members=group),
                            steps=cfg.steps, sparse_steps=cfg.sparse_steps, query_rows=cfg.query_rows,
                            split_search=cfg.split_search, placement_search=cfg.placement_search, top_k=cfg.top_k,
                            time_budget=budget, estimator=estimator,
                            memory_bytes=None if cfg.memory_budget is None else int(cfg.memory_budget * 2**30))
    return plan, [c.as_report() for c in probes.values()]


ETA_TRUST = 0.05    # the share of the estimate done before the ETA scales it by the speed measured so far


class _Eta:
    """Elapsed seconds and an ETA for the progress events, from the plan's estimate per stage: each finished unit
    (a group's pass, the split search, ...) adds its estimated share; the rest is scaled by the speed so far."""

    def __init__(self, est: dict, n_groups: int, t0: float):
        self.est, self.n, self.t0, self.done = est, max(1, n_groups), t0, 0.0
        self.total = float(est.get("total") or 0.0)

    def unit(self, stage: str, share: float = 1.0) -> float:
        per = {"split": 1.0, "placement": 1.0}.get(stage, 1.0 / self.n)
        return float(self.est.get(stage, 0.0)) * per * share

    def add(self, seconds: float) -> None:
        self.done += seconds

    def event(self, ev: dict, partial: float = 0.0) -> dict:
        el = time.time() - self.t0
        out = {**ev, "elapsed_s": round(el, 1)}
        if self.total > 0:
            done = min(self.total, self.done + partial)
            rate = el / done if done >= ETA_TRUST * self.total else 1.0   # the estimate alone until then
            out["eta_s"] = round(max(0.0, (self.total - done) * rate), 1)
        return out


class StageClock:
    """Wall seconds per stage of the retrofit, summed over the stage's calls (the report's `stage_seconds`; the
    stages are disjoint, so they add up to about the whole). On a GPU each stage ends with a synchronize, so that
    a stage's queued kernels are not billed to the next one."""

    def __init__(self, device: str):
        self.seconds: dict[str, float] = {}
        self.cuda = device.startswith("cuda")

    @contextmanager
    def __call__(self, stage: str):
        t0 = time.time()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.time() - t0


def run_retrofit(model_dir: Path, cfg: DsaConfig, progress: Optional[ProgressFn] = None, model=None) -> DsaResult:
    """Train indexers, pick the split, fit ASQ; see the module docstring. ``model``: a RefModel to reuse."""
    from ..kernels_ref.model import RefModel
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.time()
    dev = cfg.resolve_device()
    clock = StageClock(dev)
    with clock("load"):
        model = model or RefModel.from_hf(Path(model_dir), device=dev)
    hp = model.hp
    group = 1 if cfg.searches_placement else cfg.index_share
    # the layers trained: every layer when the placement is searched afterwards (each on its own target)
    types = [True] * hp.n_layer if cfg.searches_placement else cfg.indexer_types(hp.n_layer)
    emit0 = progress or (lambda d: None)
    emit0({"stage": "plan", "time_budget_s": cfg.time_budget})
    with clock("plan"):
        plan, probes = _planned(model, cfg, dev, group, types)
    ctx, n_train, n_held = plan.ctx, plan.n_train, plan.n_held
    if cfg.top_k >= ctx:
        raise BadInputError(f"--top-k {cfg.top_k} must be smaller than the calibration context {ctx} "
                            f"({plan.reason}; pass --calib-ctx)")
    if cfg.cluster_num is not None and hp.head_dim < 2:
        raise BadInputError("ASQ needs head_dim >= 2")
    with clock("load"):
        tokens = calib_chunks(cfg.calib, Path(model_dir), ctx, n_train + n_held)
    pos = torch.arange(ctx, device=model.device)
    eta = _Eta(plan.estimate, sum(1 for _ in _groups(types)), t_start)
    emit0({"stage": "plan", "ctx": ctx, "level": plan.level, "train_chunks": n_train,
           "estimate_s": plan.estimate.get("total"), "time_budget_s": plan.time_budget})
    if plan.time_budget and plan.estimate.get("total", 0) > plan.time_budget:
        emit0({"stage": "plan", "warning": f"the retrofit is estimated at {plan.estimate['total']:.0f} s, over the "
               f"{plan.time_budget:.0f} s time budget ({plan.reason}); --time-budget sets it"})
    emit = (lambda d: None) if progress is None else (lambda d: progress(eta.event(d, _partial(d))))

    def _partial(d: dict) -> float:
        """The estimated seconds done inside the current unit: a training phase's steps so far."""
        if str(d.get("stage", "")).startswith("indexer_") and d.get("steps"):
            return eta.unit("train", 0.5 * d["step"] / d["steps"])
        return 0.0
    user_split = cfg.sink is not None and cfg.local is not None
    sparse_steps = plan.sparse_steps
    log = {il: TrainLog() for il in range(hp.n_layer)}
    indexers: dict[int, IndexerWeights] = {}
    asq_layers: list[LayerAsq] = []
    rep: dict = {"config": cfg.to_dict(), "ctx": ctx, "device": dev, "freq_base": hp.rope.base,
                 "calib_tokens": int(tokens.numel()),
                 "calibration": {**plan.as_report(), "probes": probes},
                 "layers": {}}
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    asq_samples = max(cfg.cluster_num * 4, cfg.asq_samples // plan.asq_div) if cfg.cluster_num is not None else 0
    rep["calibration"]["asq_samples"] = asq_samples
    per_chunk = max(1, math.ceil(asq_samples / max(1, n_train)))

    def kw(il: int) -> dict:
        return dict(top_k=cfg.top_k, lr=cfg.lr, query_rows=plan.query_rows, seed=cfg.seed, device=dev,
                    select=cfg.select, block_size=cfg.block_size, sparse_target=cfg.sparse_target, layer=il,
                    progress=emit, log=log[il])

    # ---- pass A: dense warm-up (+ sparse phase when the split is given), ASQ samples, layer by layer
    emit({"stage": "calib_forward", "chunks": n_train + n_held, "ctx": ctx})
    with clock("calib_forward"):
        h = torch.stack([model.embed(t) for t in tokens])
    pass_b = not user_split and sparse_steps > 0
    keep_bytes = _keeps_pass_a_data(hp, types, plan, dev) if pass_b else 0
    n_keep = _kept_layers(hp, types, plan, keep_bytes) if pass_b else 0
    kept: dict[int, LayerCalib] = {}
    h_resume = None             # pass B's input at layer n_keep (the first layer whose data is not kept)
    rep["calibration"]["sparse_phase_data"] = (
        "none" if not pass_b else "kept from the first pass" if n_keep >= hp.n_layer else "recomputed" if n_keep == 0
        else f"kept for layers 0-{n_keep - 1}, recomputed from layer {n_keep}")
    rep["calibration"]["kept_layers"] = n_keep
    rep["calibration"]["kept_mib"] = round(sum(_kept_bytes(hp, plan, e - i) for i, e in _groups(types)
                                               if e <= n_keep) / 2**20)
    spaces = ("pre_rope", "post_rope") if cfg.key_space == "auto" else (cfg.key_space,)
    rope_cpu = lambda kk, pp: model.rope_keys(kk.to(model.device), pp).cpu()  # noqa: E731
    for il, end in _groups(types):
        samplers = {j: AsqSampler(per_chunk, cfg.seed + j) for j in range(il, end)} if cfg.cluster_num is not None \
            else {}
        if pass_b and il == n_keep and 0 < n_keep < hp.n_layer:
            h_resume = h[:n_train].clone()
        with clock("calib_forward"):
            data, held, h = _group_pass(model, il, end, h, pos, n_train, samplers)
        with clock("train"):
            w = init_indexer(hp.n_embd, cfg.index_heads, cfg.index_dim, cfg.rope_dim, cfg.norm_eps, hp.rope.base,
                             cfg.seed + il)
            w = train_layer(data, w, steps=plan.steps, phase="dense", **kw(il))
            if user_split:
                w = train_layer(data, w, steps=sparse_steps, phase="sparse", sink=cfg.sink, local=cfg.local, **kw(il))
        indexers[il] = w
        with clock("eval_kl"):
            rep["layers"].setdefault(il, {})["heldout_kl_dense_phase" if held is not None else "train_kl_dense_phase"] \
                = eval_kl(held if held is not None else data, w, cfg.top_k, device=dev)
        if end <= n_keep:
            kept[il] = _keep(data)
        del data, held
        for j, sampler in samplers.items():
            emit({"stage": "asq_fit", "layer": j})
            with clock("asq_fit"):
                asq_layers.append(fit_layer(sampler, rope_cpu, cfg.cluster_num, cfg.residual_bits,
                                            cfg.seed + j, spaces=spaces))
        eta.add(eta.unit("train", 0.5) + eta.unit("asq_fit") + eta.unit("eval_kl")
                + eta.unit("calib_forward", (n_train + n_held) / max(1, 2 * n_train + n_held)))
    del h

    # ---- split by calibration loss, then the sparse phase (pass B) with the chosen split
    held = tokens[n_train:] if n_held else tokens[: max(1, min(2, n_train))]
    if user_split:
        sink, local, split_source = cfg.sink, cfg.local, "user"
    else:
        with clock("split"):
            sink, local, srep = choose_split(model, held, indexers, top_k=cfg.top_k, sink=cfg.sink,
                                             select=cfg.select, block_size=cfg.block_size, progress=emit,
                                             indexer_types=types, search=plan.split_search)
        rep["split"] = srep
        split_source = "calibrated"
        eta.add(eta.unit("split"))
        if sparse_steps > 0:
            with clock("calib_forward"):
                h = torch.stack([model.embed(t) for t in tokens[:n_train]]) if n_keep == 0 else h_resume
            h_resume = None
            for il, end in _groups(types):
                if il in kept:
                    with clock("calib_forward"):
                        data = _unkeep(model, il, kept.pop(il), pos)
                else:
                    with clock("calib_forward"):
                        data, _, h = _group_pass(model, il, end, h, pos, n_train, {})
                with clock("train"):
                    indexers[il] = train_layer(data, indexers[il], steps=sparse_steps, phase="sparse", sink=sink,
                                               local=local, **kw(il))
                del data
                eta.add(eta.unit("train", 0.5) + eta.unit("calib_forward", n_train / max(1, 2 * n_train + n_held)))
            del h
    rep["sink"], rep["local"], rep["split_source"] = sink, local, split_source

    # ---- which layers keep their indexer (--index-share G, searched placement)
    if cfg.searches_placement:
        with clock("placement"):
            types, rep["placement"] = choose_full_layers(
                model, held, indexers, n_full=n_full_layers(hp.n_layer, cfg.index_share), top_k=cfg.top_k,
                sink=sink, local=local, select=cfg.select, block_size=cfg.block_size, search=plan.placement_search,
                progress=emit)
        for il in [il for il in indexers if not types[il]]:
            del indexers[il]
            rep["layers"].setdefault(il, {})["shared_after_placement"] = True

    # ---- assemble
    key_space = None
    tensors: dict[str, np.ndarray] = {}
    for il, w in indexers.items():
        tensors.update(indexer_tensors(il, w))
        lr = rep["layers"].setdefault(il, {})
        lg = log[il]
        lr.update({"dense_loss_first": lg.dense_loss[0] if lg.dense_loss else None,
                   "dense_loss_last": float(np.mean(lg.dense_loss[-10:])) if lg.dense_loss else None,
                   "sparse_loss_last": float(np.mean(lg.sparse_loss[-10:])) if lg.sparse_loss else None,
                   "train_seconds": lg.seconds})
    if asq_layers:
        key_space, means = (cfg.key_space, None) if cfg.key_space != "auto" else choose_key_space(asq_layers)
        rep["asq"] = {"key_space": key_space, "key_space_mean_err": means,
                      "layers": {il: la.errors for il, la in enumerate(asq_layers)}}
        for il, la in enumerate(asq_layers):
            tensors[f"blk.{il}.dsa.asq_k_proto"] = np.ascontiguousarray(la.k_proto[key_space].numpy())
            tensors[f"blk.{il}.dsa.asq_v_proto"] = np.ascontiguousarray(la.v_proto.numpy())
    rep["seconds"] = time.time() - t_start
    rep["calibration"]["measured_s"] = round(rep["seconds"], 1)
    rep["stage_seconds"] = {k: round(v, 3) for k, v in clock.seconds.items()}
    rep["peak_rss_mib"] = peak_rss_mib()
    if dev.startswith("cuda"):
        rep["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    emit({"stage": "done", "seconds": rep["seconds"]})
    return DsaResult(arch=hp.arch, kv=dsa_kv(hp.arch, cfg, sink, local, split_source, key_space, types),
                     tensors=tensors, report=rep)
