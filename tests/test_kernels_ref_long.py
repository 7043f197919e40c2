"""kernels_ref at long context: query-blocked attention / selection equal the full-matrix math, incremental decoding
over a KV cache equals full forwards, and the torch perplexity's KL divergence against the dense F32 run."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsa_convert.kernels_ref import asq, kvquant
from dsa_convert.kernels_ref import selection as sel
from dsa_convert.kernels_ref.generate import Decoder, greedy_generate
from dsa_convert.kernels_ref.indexer import IndexerWeights, indexer_scores
from dsa_convert.kernels_ref.model import RefHParams, RefModel
from dsa_convert.kernels_ref.rope import RopeParams
from dsa_convert.kernels_ref.sparse_attention import DsaAttention

torch.set_num_threads(2)

N_LAYER, E, H, HKV, HD, VOCAB = 4, 64, 4, 2, 32, 96
K, SINK, LOCAL = 12, 2, 3


def _model(seed: int = 0, device: str = "cpu") -> RefModel:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.3).numpy()  # noqa: E731
    w = {"token_embd.weight": r(VOCAB, E), "output_norm.weight": np.ones(E, np.float32)}
    for il in range(N_LAYER):
        p = f"blk.{il}."
        w |= {p + "attn_norm.weight": np.ones(E, np.float32), p + "ffn_norm.weight": np.ones(E, np.float32),
              p + "attn_q.weight": r(H * HD, E) * 2, p + "attn_k.weight": r(HKV * HD, E) * 2,
              p + "attn_v.weight": r(HKV * HD, E), p + "attn_output.weight": r(E, H * HD),
              p + "ffn_gate.weight": r(96, E), p + "ffn_up.weight": r(96, E), p + "ffn_down.weight": r(E, 96)}
    hp = RefHParams("llama", N_LAYER, E, H, HKV, HD, 1e-5, RopeParams(n_rot=HD, base=10000.0), VOCAB)
    return RefModel(hp, lambda n: w[n], lambda n: n in w, device=device)


def _indexer(seed: int) -> IndexerWeights:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return IndexerWeights(r(3 * 16, E), r(16, E), 1 + 0.1 * r(16), 0.1 * r(16), r(3, E), 8, 1e-6, 10000.0)


def _protos(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {il: (torch.randn(HKV, 8, HD, generator=g) * 0.5, torch.randn(HKV, 8, HD, generator=g) * 0.3)
            for il in range(N_LAYER)}


MODEL = _model()
INDEXERS = {il: _indexer(10 + il) for il in range(N_LAYER)}
PROTOS = _protos(1)
TYPES = [True, False, True, False]


def _hook(attn: str, kv: str = "f32", select: str = "token", shared: bool = False, model: RefModel = MODEL,
          **kw) -> DsaAttention:
    return DsaAttention(scale=MODEL.hp.kq_scale, attn=attn, kv=kv, top_k=K, sink=SINK, local=LOCAL, select=select,
                        block_size=2, indexers={il: INDEXERS[il] for il in range(N_LAYER) if not shared or TYPES[il]},
                        asq_protos=PROTOS, residual_bits=4, key_space="pre_rope", rope_keys=model.rope_keys, seed=5,
                        indexer_types=TYPES if shared else None, **kw)


def _close(got: torch.Tensor, want: torch.Tensor, kv: str) -> None:
    """float32 agreement. With a quantised cache a last-bit difference upstream can move a value across a rounding
    boundary of the quantiser (one step: ~1% of a q8_0 block's max), which this chaotic random model carries to
    ~0.05 in a logit; a wrong cache (e.g. keys not round-tripped) differs by ~0.3 on average and by several units."""
    if kv == "f32":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)   # logits up to ~10
    else:
        d = (got - want).abs()
        assert float(d.mean()) < 0.02 and float(d.max()) < 0.5, (float(d.mean()), float(d.max()))


# ----------------------------------------------------------------------------- full-matrix reference (plain math)
def _full_select(scores: torch.Tensor, mode: str, block_size: int = 2) -> torch.Tensor:
    """FORMAT §5 on a [T, T] score matrix with a stable sort (the straightforward definition)."""
    T = scores.shape[0]
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    causal = s <= t
    forced = causal & ((s < SINK) | (s >= t - LOCAL + 1))
    middle = causal & (s >= SINK) & (s <= t - LOCAL)
    n = K - SINK - LOCAL
    v = scores.float().masked_fill(~middle, float("-inf"))
    if mode == "token":
        order = torch.sort(v, dim=-1, descending=True, stable=True).indices[:, :n]
        picked = torch.zeros(T, T, dtype=torch.bool).scatter_(1, order, True) & middle
    else:
        nb = (T + block_size - 1) // block_size
        vp = torch.nn.functional.pad(v, (0, nb * block_size - T), value=float("-inf")).view(T, nb, block_size)
        bs = vp.amax(-1)
        order = torch.sort(bs, dim=-1, descending=True, stable=True).indices[:, :n // block_size]
        pb = torch.zeros(T, nb, dtype=torch.bool).scatter_(1, order, True)
        picked = pb.repeat_interleave(block_size, 1)[:, :T] & middle
    mask = forced | picked
    dense = (t[:, 0] + 1) <= K
    mask[dense] = causal[dense]
    return mask


class FullHook:
    """The same modes computed on whole [T, T] matrices (no blocks, no cache): the reference."""

    def __init__(self, attn: str, kv: str = "f32", select: str = "token", shared: bool = False):
        self.attn, self.kv, self.select, self.shared = attn, kv, select, shared
        self.masks: dict[int, torch.Tensor | None] = {}
        self._last_full = None

    def mask(self, layer, q, k, x, positions):
        T = q.shape[1]
        if self.attn == "dense" or T <= K:
            return None
        if self.attn == "local":
            t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
            m = (s <= t) & ((s < SINK) | (s >= t - (K - SINK) + 1))
            m[(t[:, 0] + 1) <= K] = (s <= t)[(t[:, 0] + 1) <= K]
            return m
        if self.attn == "random":
            return _full_select(sel.random_scores(torch.arange(T), T, 5 + layer), "token")
        if self.attn == "oracle":
            rep = H // HKV
            lg = q @ k.repeat_interleave(rep, 0).transpose(-1, -2) * MODEL.hp.kq_scale
            lg = lg.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            return _full_select(torch.softmax(lg, -1).sum(0), self.select)
        if self.shared and not TYPES[layer]:
            return self._last_full
        self._last_full = _full_select(indexer_scores(x, positions, INDEXERS[layer]), self.select)
        return self._last_full

    def __call__(self, layer, q, k, v, x, k_pre, positions):
        m = self.mask(layer, q, k, x, positions)
        self.masks[layer] = m
        if self.kv == "asq":
            kp, vp = PROTOS[layer]
            k = MODEL.rope_keys(asq.roundtrip_heads(k_pre, kp, 4), positions)
            v = asq.roundtrip_heads(v, vp, 4)
        else:
            k, v = kvquant.kv_roundtrip(k, self.kv), kvquant.kv_roundtrip(v, self.kv)
        T = q.shape[1]
        m = torch.ones(T, T, dtype=torch.bool).tril() if m is None else m
        rep = H // HKV
        lg = q @ k.repeat_interleave(rep, 0).transpose(-1, -2) / math.sqrt(HD)
        p = torch.softmax(lg.masked_fill(~m, float("-inf")), -1)
        return p @ v.repeat_interleave(rep, 0)


TOKENS = torch.tensor(np.random.default_rng(0).integers(0, VOCAB, size=40))

MODES = [("dense", "f32", "token", False), ("sparse", "f32", "token", False), ("sparse", "f32", "block", False),
         ("sparse", "f32", "token", True), ("local", "f32", "token", False), ("random", "f32", "token", False),
         ("oracle", "f32", "token", False), ("oracle", "q8_0", "block", False), ("sparse", "asq", "token", False),
         ("local", "q4_0", "token", False)]
# (no f16 cache here: a float32 rounding difference upstream flips an f16 rounding now and then, 1e-3 relative)


@pytest.mark.parametrize("attn,kv,select,shared", MODES)
def test_blocked_forward_equals_full_matrix_math(attn, kv, select, shared):
    ref = FullHook(attn, kv, select, shared)
    want = MODEL.forward(TOKENS, attention=ref)
    for rows in (5, 16):          # blocks smaller than T (40), not dividing it
        got = MODEL.forward(TOKENS, attention=_hook(attn, kv, select, shared, block_rows=rows))
        _close(got, want, kv)
    if attn != "dense":
        assert any(m is not None and not torch.equal(m, torch.ones(40, 40, dtype=torch.bool).tril())
                   for m in ref.masks.values())


@pytest.mark.parametrize("attn,select,shared", [("sparse", "token", False), ("sparse", "block", True),
                                                ("oracle", "token", False), ("random", "token", False),
                                                ("local", "token", False)])
def test_blocked_masks_equal_full_masks(attn, select, shared):
    ref = FullHook(attn, "f32", select, shared)
    hook = _hook(attn, "f32", select, shared, block_rows=7)
    caught = {}

    def cap(il, name, t):
        caught[(il, name)] = t

    MODEL.forward(TOKENS, attention=ref, capture=cap)
    pos = torch.arange(40)
    for il in range(N_LAYER):
        q, k, x = caught[(il, "q")], caught[(il, "k")], caught[(il, "attn_in")]
        assert torch.equal(hook._mask(il, q, k, x, pos), ref.masks[il]), il


def test_dense_hook_is_the_default_attention_bit_for_bit():
    assert torch.equal(MODEL.forward(TOKENS), MODEL.forward(TOKENS, attention=_hook("dense")))
    # top_k >= T: every row attends densely, identical to dense
    big = DsaAttention(scale=MODEL.hp.kq_scale, attn="sparse", top_k=64, sink=1, local=1, indexers=INDEXERS)
    assert torch.equal(MODEL.forward(TOKENS), MODEL.forward(TOKENS, attention=big))


# ----------------------------------------------------------------------------- selection pieces
@pytest.mark.parametrize("mode", ["token", "block"])
def test_row_blocks_of_selection_equal_the_full_selection(mode):
    g = torch.Generator().manual_seed(3)
    T = 50
    sc = torch.randn(T, T, generator=g).round(decimals=1)     # many exact ties
    full = sel.select(sc, K, SINK, LOCAL, mode, 2)
    assert torch.equal(full, _full_select(sc, mode))
    for a, b in ((0, 7), (7, 30), (30, 50), (49, 50)):
        # rows [a, b) against their causal keys [0, b): the rows are the last of those keys
        assert torch.equal(sel.select(sc[a:b, :b], K, SINK, LOCAL, mode, 2), full[a:b, :b])
        assert torch.equal(sel.select(sc[a:b], K, SINK, LOCAL, mode, 2, row0=a), full[a:b])


def test_top_indices_ties_and_invalid():
    v = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    valid = torch.tensor([[True] * 6, [False, True, True, False, False, False]])
    got = [sorted(r) for r in sel.top_indices(v, valid, 3).tolist()]
    assert got == [[0, 1, 3], [0, 1, 2]]   # row 0: the lowest of the tied zeros; row 1: invalid index 0 fills in
    g = torch.Generator().manual_seed(0)
    for v in (torch.randint(0, 4, (30, 200), generator=g).float(), torch.randn(30, 200, generator=g)):
        valid = torch.rand(30, 200, generator=g) < torch.linspace(0.02, 1, 30)[:, None]   # some rows < 17 valid
        for ok in (None, valid):
            m = v if ok is None else v.masked_fill(~ok, float("-inf"))
            want = torch.sort(m, dim=-1, descending=True, stable=True).indices[:, :17]
            assert torch.equal(sel.top_indices(v, ok, 17).sort(-1).values, want.sort(-1).values)


def test_random_scores_depend_on_seed_and_position_only():
    a = sel.random_scores(torch.arange(10, 20), 30, seed=7)
    b = sel.random_scores(torch.arange(0, 40), 30, seed=7)
    assert torch.equal(a, b[10:20]) and not torch.equal(a, sel.random_scores(torch.arange(10, 20), 30, seed=8))
    assert 0 <= float(a.min()) and float(a.max()) < 1 and 0.4 < float(b.mean()) < 0.6
    assert torch.equal(sel.random_scores(torch.arange(3), 30, 7), sel.random_scores(torch.arange(5), 30, 7)[:3])


# ----------------------------------------------------------------------------- incremental decoding
DECODE_MODES = [("dense", "f32", "token", False), ("sparse", "f32", "token", False), ("sparse", "f32", "block", True),
                ("local", "f32", "token", False), ("oracle", "q8_0", "token", False), ("sparse", "asq", "token", False),
                ("random", "q4_0", "token", False)]


@pytest.mark.parametrize("attn,kv,select,shared", DECODE_MODES)
def test_decode_steps_equal_full_forward(attn, kv, select, shared):
    hook = _hook(attn, kv, select, shared, block_rows=6)
    full = MODEL.forward(TOKENS, attention=_hook(attn, kv, select, shared))
    for prompt in (9, 20):        # a prompt shorter than top_k (the decode crosses t + 1 = K) and a longer one
        dec = Decoder(MODEL, hook)
        got = [dec.feed(TOKENS[:prompt].tolist())] + [dec.feed([int(TOKENS[t])]) for t in range(prompt, 40)]
        _close(torch.stack(got), full[prompt - 1:], kv)
    assert hook.cache is None and not hook.selected_fraction   # the caller's hook is untouched


def test_greedy_generate_follows_full_forward_argmax():
    hook = _hook("sparse", "f32", "token", True)
    prompt = TOKENS[:16].tolist()
    got = greedy_generate(MODEL, prompt, 8, attention=hook)
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(torch.argmax(MODEL.forward(torch.tensor(seq), attention=hook)[-1])))
    assert got == seq[16:] and len(got) == 8
    stop = greedy_generate(MODEL, prompt, 8, attention=hook, stop_ids={got[2]})
    assert stop == got[:got.index(got[2]) + 1]
    assert greedy_generate(MODEL, prompt, 0) == []
    with pytest.raises(ValueError):
        greedy_generate(MODEL, [], 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU machine)")
@pytest.mark.parametrize("attn,kv,select,shared", DECODE_MODES)
def test_cuda_equals_cpu(attn, kv, select, shared):
    gpu = _model(device="cuda")
    want = MODEL.forward(TOKENS, attention=_hook(attn, kv, select, shared))
    got = gpu.forward(TOKENS, attention=_hook(attn, kv, select, shared, model=gpu, block_rows=7))
    _close(got.cpu(), want, kv)
    dec = Decoder(gpu, _hook(attn, kv, select, shared, model=gpu))
    got = [dec.feed(TOKENS[:20].tolist())] + [dec.feed([int(TOKENS[t])]) for t in range(20, 40)]
    _close(torch.stack(got).cpu(), want[19:], kv)


# ----------------------------------------------------------------------------- KL divergence (torch perplexity)
def test_torch_perplexity_kld_zero_for_dense_and_positive_for_local():
    from dsa_convert.eval.perplexity_torch import perplexity_torch

    toks = np.random.default_rng(1).integers(0, VOCAB, size=96).tolist()
    kw = dict(ctx=48, tokens=toks, model=MODEL, kld=True)
    dense = perplexity_torch(None, None, attn="dense", kv="f32", **kw)
    assert dense["kld_mean"] == 0.0 and dense["kld_max"] == 0.0 and dense["same_top_p"] == 1.0
    assert dense["kld_tokens"] == 2 * (48 - 1 - 24)
    local = perplexity_torch(None, None, attn="local", kv="f32", top_k=8, **kw)
    assert local["kld_mean"] > 1e-4 and local["kld_tokens"] == dense["kld_tokens"]
    f16 = perplexity_torch(None, None, attn="dense", kv="f16", **kw)
    assert 0 < f16["kld_mean"] < local["kld_mean"]
    plain = perplexity_torch(None, None, attn="local", kv="f32", top_k=8, ctx=48, tokens=toks, model=MODEL)
    assert "kld_mean" not in plain and plain["ppl"] == local["ppl"]
    # the NLL equals a straightforward log-softmax over the full logits
    logits = MODEL.forward(torch.tensor(toks[:48])).double()
    nll = -torch.log_softmax(logits[24:47], -1)[torch.arange(23), torch.tensor(toks[25:48])]
    logits2 = MODEL.forward(torch.tensor(toks[48:96])).double()
    nll2 = -torch.log_softmax(logits2[24:47], -1)[torch.arange(23), torch.tensor(toks[73:96])]
    assert dense["ppl"] == pytest.approx(math.exp(float(torch.cat([nll, nll2]).mean())), rel=1e-9)
