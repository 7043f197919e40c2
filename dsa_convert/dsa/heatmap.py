"""`dsa inspect FILE --heatmap out.png --text FILE --layer N`: for one layer, the indexer's
selection drawn over the dense model's true attention (head-summed), so a person can see what
the sparse gate keeps and what it drops, with the attention mass it captures per query."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import BadInputError


def _tokens(gguf_path: Path, text: str, n: int) -> list[int]:
    from ..backend.llama_runner import vocab_tokens_isolated

    try:
        toks, _ = vocab_tokens_isolated(gguf_path, text)
    except Exception as e:
        raise BadInputError(f"--heatmap needs the llama.cpp backend to tokenise with the file's vocab: {e}") from None
    return toks[:n]


def write_heatmap(gguf_path: Path, out: Path, text: Path | None, layer: int, n_tokens: int = 384) -> dict:
    from ..eval.perplexity_torch import dsa_settings_from_gguf
    from ..formats.atomic import atomic_output
    from ..kernels_ref.indexer import indexer_scores
    from ..kernels_ref.model import RefModel
    from ..kernels_ref.selection import select
    from ..kernels_ref.sparse_attention import attention_probs

    if text is None or not Path(text).is_file():
        raise BadInputError("--heatmap needs --text FILE (an existing text file)")
    from .config import full_layer_of

    model = RefModel.from_gguf(gguf_path)
    st = dsa_settings_from_gguf(model)
    if not 0 <= layer < model.hp.n_layer:
        raise BadInputError(f"--layer {layer} is out of range (the model has {model.hp.n_layer} layers)")
    # a shared layer (FORMAT §4a) shows the picks it reuses
    src = full_layer_of(st.get("indexer_types"), layer, st.get("indexers", {}))
    if src not in st.get("indexers", {}):
        raise BadInputError(f"{Path(gguf_path).name}: layer {layer} has no indexer (layers with one: "
                            f"{sorted(st.get('indexers', {})) or 'none'})")
    toks = _tokens(Path(gguf_path), Path(text).read_text(encoding="utf-8", errors="replace"), n_tokens)
    T = len(toks)
    K = int(st["top_k"])
    if T <= K:
        raise BadInputError(f"--text gives {T} tokens; need more than top-k ({K}) to show a selection")
    grabbed = {}
    pos = torch.arange(T)

    def cap(il, name, t):
        if (il == layer and name in ("q", "k")) or (il == src and name == "attn_in"):
            grabbed[name] = t

    with torch.no_grad():
        h = model.embed(torch.tensor(toks))
        for il in range(layer + 1):
            h = model.layer(il, h, pos, capture=cap)
        probs = attention_probs(grabbed["q"], grabbed["k"], scale=model.hp.kq_scale).sum(0)   # [T, T], rows sum to H
        probs = probs / probs.sum(-1, keepdim=True)
        sc = indexer_scores(grabbed["attn_in"], pos, st["indexers"][src])
        sel = select(sc, K, int(st.get("sink", 0)), int(st.get("local", 1)), st.get("select", "token"),
                     int(st.get("block_size", 64)))
    captured = (probs * sel).sum(-1).numpy()
    rows = np.arange(T) >= K
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 6.5), gridspec_kw={"width_ratios": [3, 1.2]})
    ax = axes[0]
    img = np.log10(probs.numpy() + 1e-6)
    ax.imshow(img, cmap="Greys", vmin=-4, vmax=0, interpolation="nearest")
    ys, xs = np.nonzero(sel.numpy() & rows[:, None])
    ax.scatter(xs, ys, s=0.15, c="tab:red", alpha=0.5, linewidths=0)
    whose = "indexer selection" if src == layer else f"selection of layer {src}'s indexer (shared)"
    ax.set_title(f"layer {layer}: dense attention (grey, log10, heads summed) and {whose} (red)\n"
                 f"top-k {K} = sinks {st.get('sink', 0)} + local {st.get('local')} + picks; {T} tokens")
    ax.set_xlabel("key position s")
    ax.set_ylabel("query position t")
    ax2 = axes[1]
    ax2.plot(captured[rows], np.arange(T)[rows], lw=0.8)
    ax2.invert_yaxis()
    ax2.set_xlim(0, 1.01)
    ax2.set_xlabel("dense attention mass inside the selection")
    ax2.set_title(f"mean {captured[rows].mean():.3f} (queries t ≥ top-k)")
    fig.tight_layout()
    with atomic_output(Path(out)) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return {"png": str(out), "layer": layer, "indexer_layer": src, "tokens": T, "top_k": K,
            "mean_attention_mass_captured": float(captured[rows].mean())}
