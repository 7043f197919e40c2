"""DSA retrofit of a HF Llama-family checkpoint: indexer distillation, sink/local split, ASQ fit.

    res = run_retrofit(Path("model_dir"), DsaConfig(top_k=512, calib=Path("calib.txt")))
    res.kv       {"llama.attention.indexer.top_k": (512, GGUFValueType.UINT32), ...}
    res.tensors  {"blk.0.indexer.attn_q_b.weight": np.ndarray [H*D, n_embd], ...}  (gguf-py order)
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
training device (on a GPU this avoids a host-to-device copy per training step). When every layer's activations fit in
memory beside that, the sparse phase after the split search reuses them instead of a second pass over the model (on
a 2-core CPU at 32K that pass is most of the phase). K prototypes are in
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
from ..kernels_ref.indexer import IndexerWeights
from ..resources import peak_rss_mib
from .asq_fit import AsqSampler, LayerAsq, choose_key_space, fit_layer
from .calib import MEMORY_SHARE, activation_bytes_per_token, calib_chunks, free_memory_bytes, plan_calibration
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
        for name in self.tensors:
            if name.endswith(".indexer.attn_q_b.weight"):
                il = int(name.split(".")[1])
                t = lambda s: torch.from_numpy(self.tensors[f"blk.{il}.indexer.{s}"])  # noqa: E731
                out[il] = IndexerWeights(t("attn_q_b.weight"), t("attn_k.weight"), t("k_norm.weight"),
                                         t("k_norm.bias"), t("proj.weight"), rope_dim, eps, base)
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
    # q_b, k and proj back to back (FORMAT.md §3): the patched runtime then multiplies them as one matrix
    return {p + "attn_q_b.weight": f(w.W_q), p + "attn_k.weight": f(w.W_k), p + "proj.weight": f(w.W_w),
            p + "k_norm.weight": f(w.gamma), p + "k_norm.bias": f(w.beta)}


def _model_ctx(model) -> int:
    spec = getattr(model, "spec", None)
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


def _keeps_pass_a_data(hp, types: list[bool], plan, dev: str) -> bool:
    """Whether every group's training activations (x of the full layer, q / k of all layers, float32) fit beside the
    plan's working set in MEMORY_SHARE of the free memory: then the sparse phase reuses them instead of running the
    frozen model over the calibration chunks a second time (the same values: each chunk's forward is independent)."""
    per_token = 4 * (sum(types) * hp.n_embd + len(types) * (hp.n_head + hp.n_head_kv) * hp.head_dim)
    need = plan.n_train * plan.ctx * per_token
    working = (plan.n_train + plan.n_held) * plan.ctx * plan.bytes_per_token
    return need + working <= MEMORY_SHARE * free_memory_bytes(dev)


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
    plan = plan_calibration(ctx=cfg.ctx, calib_tokens=cfg.calib_tokens, calib_chunks=cfg.calib_chunks,
                            split_chunks=cfg.split_chunks, model_ctx=_model_ctx(model), device=dev,
                            bytes_per_token=activation_bytes_per_token(hp.n_embd, hp.n_head, hp.n_head_kv,
                                                                       hp.head_dim, members=group),
                            steps=cfg.steps, sparse_steps=cfg.sparse_steps, query_rows=cfg.query_rows,
                            split_search=cfg.split_search, placement_search=cfg.placement_search)
    ctx, n_train, n_held = plan.ctx, plan.n_train, plan.n_held
    if cfg.top_k >= ctx:
        raise BadInputError(f"--top-k {cfg.top_k} must be smaller than the calibration context {ctx} "
                            f"({plan.reason}; pass --calib-ctx)")
    if cfg.cluster_num is not None and hp.head_dim < 2:
        raise BadInputError("ASQ needs head_dim >= 2")
    with clock("load"):
        tokens = calib_chunks(cfg.calib, Path(model_dir), ctx, n_train + n_held)
    pos = torch.arange(ctx, device=model.device)
    emit = progress or (lambda d: None)
    user_split = cfg.sink is not None and cfg.local is not None
    sparse_steps = plan.sparse_steps
    log = {il: TrainLog() for il in range(hp.n_layer)}
    # the layers trained: every layer when the placement is searched afterwards (each on its own target)
    types = [True] * hp.n_layer if cfg.searches_placement else cfg.indexer_types(hp.n_layer)
    indexers: dict[int, IndexerWeights] = {}
    asq_layers: list[LayerAsq] = []
    rep: dict = {"config": cfg.to_dict(), "ctx": ctx, "device": dev, "freq_base": hp.rope.base,
                 "calib_tokens": int(tokens.numel()),
                 "calibration": plan.as_report(),
                 "layers": {}}
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    per_chunk = max(1, math.ceil(cfg.asq_samples / max(1, n_train)))

    def kw(il: int) -> dict:
        return dict(top_k=cfg.top_k, lr=cfg.lr, query_rows=plan.query_rows, seed=cfg.seed, device=dev,
                    select=cfg.select, block_size=cfg.block_size, sparse_target=cfg.sparse_target, layer=il,
                    progress=emit, log=log[il])

    # ---- pass A: dense warm-up (+ sparse phase when the split is given), ASQ samples, layer by layer
    emit({"stage": "calib_forward", "chunks": n_train + n_held, "ctx": ctx})
    with clock("calib_forward"):
        h = torch.stack([model.embed(t) for t in tokens])
    pass_b = not user_split and sparse_steps > 0
    kept: dict[int, LayerCalib] | None = {} if pass_b and _keeps_pass_a_data(hp, types, plan, dev) else None
    rep["calibration"]["sparse_phase_data"] = ("kept from the first pass" if kept is not None else
                                               "recomputed" if pass_b else "none")
    spaces = ("pre_rope", "post_rope") if cfg.key_space == "auto" else (cfg.key_space,)
    rope_cpu = lambda kk, pp: model.rope_keys(kk.to(model.device), pp).cpu()  # noqa: E731
    for il, end in _groups(types):
        samplers = {j: AsqSampler(per_chunk, cfg.seed + j) for j in range(il, end)} if cfg.cluster_num is not None \
            else {}
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
        if kept is not None:
            kept[il] = data
        del data, held
        for j, sampler in samplers.items():
            emit({"stage": "asq_fit", "layer": j})
            with clock("asq_fit"):
                asq_layers.append(fit_layer(sampler, rope_cpu, cfg.cluster_num, cfg.residual_bits,
                                            cfg.seed + j, spaces=spaces))
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
        if sparse_steps > 0:
            with clock("calib_forward"):
                h = torch.stack([model.embed(t) for t in tokens[:n_train]]) if kept is None else None
            for il, end in _groups(types):
                if kept is not None:
                    data = kept.pop(il)
                else:
                    with clock("calib_forward"):
                        data, _, h = _group_pass(model, il, end, h, pos, n_train, {})
                with clock("train"):
                    indexers[il] = train_layer(data, indexers[il], steps=sparse_steps, phase="sparse", sink=sink,
                                               local=local, **kw(il))
                del data
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
    rep["stage_seconds"] = {k: round(v, 3) for k, v in clock.seconds.items()}
    rep["peak_rss_mib"] = peak_rss_mib()
    if dev.startswith("cuda"):
        rep["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    emit({"stage": "done", "seconds": rep["seconds"]})
    return DsaResult(arch=hp.arch, kv=dsa_kv(hp.arch, cfg, sink, local, split_source, key_space, types),
                     tensors=tensors, report=rep)
