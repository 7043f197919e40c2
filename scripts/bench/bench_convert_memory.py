#!/usr/bin/env python3
"""Peak RSS of `dsa convert` does not grow with model size: synthetic Llama checkpoints of the same
widths and 4 / 16 / 32 layers (bf16, sharded), converted to F16, each in a fresh process (peak RSS from
wait4). Tokenizer files are taken from the reference model.

    python scripts/bench/bench_convert_memory.py [--layers 4,16,32] [--hidden 1024] [--ffn 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
REF = REPO.parent / "shared" / "models" / "ref-llama-27m"


def make_checkpoint(d: Path, layers: int, hidden: int, ffn: int, vocab: int = 16384) -> int:
    d.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REF / f, d / f)
    heads, kv = hidden // 64, max(1, hidden // 256)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
    (d / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    wmap, shard, n, total = {}, {}, 0, 0

    def flush():
        nonlocal shard, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, d / name, metadata={"format": "pt"})
            wmap.update({k: name for k in shard})
            shard, n = {}, n + 1

    shard["model.embed_tokens.weight"] = r(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shard.update({p + "self_attn.q_proj.weight": r(hidden, hidden), p + "self_attn.k_proj.weight": r(kv * 64, hidden),
                      p + "self_attn.v_proj.weight": r(kv * 64, hidden), p + "self_attn.o_proj.weight": r(hidden, hidden),
                      p + "mlp.gate_proj.weight": r(ffn, hidden), p + "mlp.up_proj.weight": r(ffn, hidden),
                      p + "mlp.down_proj.weight": r(hidden, ffn), p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                      p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
        flush()
    shard["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    shard["lm_head.weight"] = r(vocab, hidden)
    flush()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="4,16,32")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-mem-"))
    print("| layers | checkpoint MiB | largest tensor MiB (f32) | output MiB | wall s | peak RSS MiB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for L in [int(x) for x in a.layers.split(",")]:
        d = work / f"m{L}"
        size = make_checkpoint(d, L, a.hidden, a.ffn)
        out = work / f"m{L}.gguf"
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "dsa_convert.cli", "convert", str(d), str(out), "--outtype", "f16"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, ru = os.wait4(p.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        largest = 16384 * a.hidden * 4 / 2**20
        print(f"| {L} | {size / 2**20:.0f} | {largest:.0f} | {out.stat().st_size / 2**20:.0f} | "
              f"{time.perf_counter() - t0:.1f} | {ru.ru_maxrss / 1024:.0f} |", flush=True)
        shutil.rmtree(d)
        out.unlink()


if __name__ == "__main__":
    main()
