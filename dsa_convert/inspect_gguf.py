"""`dsa inspect`: what a GGUF holds — architecture, hyper-parameters, tokenizer, DSA, tensors."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from .formats.gguf_read import GgufFile


def _plain(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "item"):
        return v.item()
    return v


def summarize(path: Path) -> dict:
    g = GgufFile(path)
    arch = g.arch
    hparams, dsa = {}, {}
    for k in g.keys():
        if not k.startswith(arch + "."):
            continue
        short = k[len(arch) + 1:]
        v = _plain(g.get(k))
        (dsa if short.startswith(("dsa.", "attention.indexer.")) else hparams)[short] = v
    tokens = g.get("tokenizer.ggml.tokens") or []
    tok = {
        "model": g.get("tokenizer.ggml.model"), "pre": g.get("tokenizer.ggml.pre"),
        "n_tokens": len(tokens), "n_merges": len(g.get("tokenizer.ggml.merges") or []),
        "bos_token_id": _plain(g.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _plain(g.get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": _plain(g.get("tokenizer.ggml.padding_token_id")),
        "add_bos_token": _plain(g.get("tokenizer.ggml.add_bos_token")),
        "chat_template": g.get("tokenizer.chat_template") is not None,
    }
    tensors = [{"name": t.name, "type": t.type_name, "shape": list(t.shape), "bytes": t.n_bytes,
                "bpw": round(t.bits_per_weight, 3)} for t in g.tensors.values()]
    n_el = sum(t.n_elements for t in g.tensors.values())
    n_bytes = sum(t.n_bytes for t in g.tensors.values())
    by_type = Counter(t.type_name for t in g.tensors.values())
    general = {k: _plain(g.get(k)) for k in g.keys() if k.startswith("general.")}
    return {
        "file": str(path), "file_bytes": Path(path).stat().st_size, "architecture": arch,
        "general": general, "hparams": hparams, "tokenizer": tok, "dsa": dsa,
        "tensors": tensors,
        "totals": {"tensors": len(tensors), "parameters": n_el, "tensor_bytes": n_bytes,
                   "bits_per_weight": round(8.0 * n_bytes / max(1, n_el), 3), "types": dict(by_type)},
    }


def render(summary: dict, console) -> None:
    from rich.table import Table

    s = summary
    console.print(f"[bold]{s['file']}[/bold]  {s['architecture']}  {s['file_bytes'] / 2**20:.1f} MiB")
    kv = Table(title="hyper-parameters", show_header=False)
    for k, v in s["hparams"].items():
        kv.add_row(k, str(v))
    console.print(kv)
    t = s["tokenizer"]
    console.print(f"tokenizer: {t['model']} pre={t['pre']} tokens={t['n_tokens']} merges={t['n_merges']} "
                  f"bos={t['bos_token_id']} eos={t['eos_token_id']} pad={t['pad_token_id']} "
                  f"add_bos={t['add_bos_token']} chat_template={'yes' if t['chat_template'] else 'no'}")
    if s["dsa"]:
        d = Table(title="DSA / ASQ", show_header=False)
        for k, v in s["dsa"].items():
            d.add_row(k, str(v))
        console.print(d)
    tt = Table(title="tensors")
    for col in ("name", "type", "shape", "bytes", "bpw"):
        tt.add_column(col, justify="right" if col in ("bytes", "bpw") else "left")
    for r in s["tensors"]:
        tt.add_row(r["name"], r["type"], "×".join(map(str, r["shape"])), f"{r['bytes']:,}", f"{r['bpw']:.2f}")
    console.print(tt)
    tot = s["totals"]
    console.print(f"total: {tot['tensors']} tensors, {tot['parameters']:,} parameters, {tot['tensor_bytes']:,} bytes, "
                  f"{tot['bits_per_weight']:.3f} bits/weight, types {tot['types']}")
