#!/usr/bin/env python3
"""Write patches/llama.cpp/ as a series of one feature per patch from a patched llama.cpp git tree.

    python3 scripts/write_patch_series.py TREE [--base REV] [--head REV] [--out patches/llama.cpp] [--branch NAME]
                                          [--list]

TREE is a llama.cpp checkout (git) whose BASE revision is the llama.cpp vendored in llama-cpp-python (see
dsa_convert/backend/build.py) and whose HEAD holds the project's changes, in any commits. The change BASE..HEAD is
cut into units: a hunk of `git diff -U0`, and a hunk that only adds lines is cut further where a new top-level item
begins (a blank line, then a line at column 0 other than a closing brace or preprocessor line; in
tests/test-backend-ops.cpp also before an indented comment, to separate groups of test cases), and around each
#if / #else / #endif line, which goes to the patch of its #if. SERIES below assigns
every unit to one patch: a rule (path pattern, regex) whose regex matches the unit's text claims it; a unit no regex
claims goes with the unit before it in the same hunk unless it begins a top-level item, or else to the first rule for
its path without a regex. A unit
no rule claims is an error. Patch k is the difference between the trees with the units of patches 1..k-1 and 1..k
applied, so the series applies in order to a pristine tree and gives HEAD exactly (`dsa backend build` applies
patches/llama.cpp/*.patch in name order).

--branch NAME also commits those trees to TREE as branch NAME (one commit per patch), to build each prefix.
--list prints every unit with the patch it went to.
"""
from __future__ import annotations

import argparse
import fnmatch
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Patch:
    name: str
    header: str
    rules: list[tuple[str, str | None]] = field(default_factory=list)   # (path glob, regex or None)


CUDA = "ggml/src/ggml-cuda/"
MODELS = "src/models/*.cpp"
TOPK_CUDA = r"GGML_CUDA_TOP_K_RADIX|topk_radix|top-k-radix|new test_top_k\("
CUDA_FUSION = (r"norm_mul_add|lightning_indexer_rope|dsa_lid_next_top_k|dsa_top_k_after|zero the scratch|"
               r"test_dsa_lid_rope_top_k|test_dsa_key_norm_rope_store|LayerNorm with weight and bias|"
               r"ROPE node folded|query's ROPE")
CUDA_STREAMS = (r"priority|graph_instantiate|concurrent_events|graph_optimize|enable_graph_optimization|"
                r"fan_out|stray_noops|stray no-op|graph_has_sparse_attn|has_indexer|indexer's branch|"
                r"DSA layer's attn_norm|DSA layer's single-token graph|no-op that depends on no branch|"
                r"Without GGML_CUDA_GRAPH_OPT")

SERIES = [
    Patch("0001-llama-dsa-model-format.patch",
          "llama: GGUF keys and tensors of lightning-indexer sparse attention for llama / qwen2 / qwen3\n\n"
          "{arch}.attention.indexer.* (upstream's keys: head count, key length, top-k, per-layer types) and\n"
          "{arch}.dsa.* (sinks, local window, indexer RoPE dims and norm eps, ASQ cache bits and key space), the\n"
          "blk.N.indexer.* tensors and the ASQ prototypes. All optional: a file without them loads as before. The\n"
          "indexer's q/k/w projections are loaded as one tensor when the file stores them back to back.\n",
          [("src/llama-arch.h", None), ("src/llama-arch.cpp", None), ("src/llama-hparams.h", None),
           ("src/llama-model.h", None), ("src/llama-model.cpp", r"load_dsa_hparams|load_dsa_tensors|finish_dsa_tensors|^// Lightning-indexer sparse attention"),
           (MODELS, r"load_dsa|finish_dsa_tensors|Optional lightning-indexer sparse attention$")]),
    Patch("0002-ggml-dsa-ops.patch",
          "ggml: operators for sparse attention over a llama-family KV cache, CPU implementations and tests\n\n"
          "New ops (RPC_PROTO_PATCH_VERSION bumped):\n"
          "  GGML_OP_DSA_ASQ_SET_ROWS / GGML_OP_DSA_ASQ_GET_ROWS  encode / decode KV vectors of the ASQ compressed cache\n"
          "                                                       (prototype id, f16 residual scale, 4- or 8-bit levels)\n"
          "  GGML_OP_DSA_SPARSE_ATTN   attention over the top-k selected cells of an F16/F32 or ASQ cache, read in place\n"
          "  GGML_OP_DSA_INDEXER_MASK  the lightning indexer's mask (and a decode ubatch's visibility mask) from positions\n"
          "Changed: ggml_lightning_indexer also takes an F32 mask; ggml_lightning_indexer_scaled folds the head-weight\n"
          "scale; the CPU lightning indexer converts each key once per block of keys scored against every token.\n",
          [("ggml/include/ggml.h", None), ("ggml/include/ggml-rpc.h", None), ("ggml/src/ggml.c", None),
           ("ggml/src/ggml-cpu/ggml-cpu.c", None), ("ggml/src/ggml-cpu/ops.h", None),
           ("ggml/src/ggml-cpu/ops.cpp", None), ("tests/test-backend-ops.cpp", None)]),
    Patch("0003-ggml-cpu-top-k-select.patch",
          "ggml-cpu: ggml_top_k in O(n) per row (std::nth_element on a copy, then one scan) instead of a partial sort\n\n"
          "Changes every ggml_top_k on the CPU (also MoE routing): same set of indices; ties at the k-th value go to\n"
          "the lower index.\n",
          [("ggml/src/ggml-cpu/ops.cpp", r"top_k|<functional>|dst_data = \(int32_t \*\)")]),
    Patch("0004-ggml-cuda-top-k-radix-select.patch",
          "ggml-cuda: radix-select ggml_top_k for rows longer than 1024\n\n"
          "One block per row for prefill, a persistent cooperative kernel for decode rows and thread-block clusters on\n"
          "Hopper; rows up to 1024 keep the bitonic sort. Changes every ggml_top_k on CUDA with long rows. The scratch a\n"
          "decode select needs can be zeroed by the kernel before it (ggml_cuda_top_k_zero_by_lid).\n",
          [(CUDA + "top-k*", None), (CUDA + "common.cuh", r"dsa_topk_scratch|dsa_lid_next_top_k"),
           ("tests/test-backend-ops.cpp", TOPK_CUDA)]),
    Patch("0005-ggml-cuda-dsa-kernels.patch",
          "ggml-cuda: kernels for the DSA ops and the lightning indexer's shapes beyond upstream's\n\n"
          "Sparse attention (split-K online softmax; score-first and tensor-core forms), ASQ encode / decode, the\n"
          "indexer mask, and the decode / prefill lightning indexer (tensor cores on Ampere+). supports_op reports\n"
          "exactly the shapes the kernels take; the DSA kernels are NVIDIA CUDA only (HIP / MUSA report them\n"
          "unsupported).\n",
          [(CUDA + "dsa-*", None), (CUDA + "lightning-indexer.cu", None),
           (CUDA + "rope.cu*", r"^ggml_cuda_rope_yarn ggml_cuda_rope_yarn_of|YaRN parameters from op_params"), (CUDA + "ggml-cuda.cu", r'#include "ggml-cuda/dsa-|case GGML_OP_DSA_')]),
    Patch("0006-ggml-cuda-dsa-fusions.patch",
          "ggml-cuda: fusions of the DSA layer's graph\n\n"
          "NORM -> MUL -> ADD (LayerNorm with weight and bias) in one kernel, and with RESHAPE -> ROPE -> VIEW ->\n"
          "SET_ROWS the indexer key's whole path into its cache; the indexer query's ROPE folded into the decode\n"
          "indexer, which also zeroes the scratch of the top-k after it; fill writes 16 bytes per thread.\n",
          [(CUDA + "lightning-indexer.cuh", None), (CUDA + "lightning-indexer.cu", CUDA_FUSION),
           (CUDA + "norm.cu*", None), (CUDA + "rope.cu*", None), (CUDA + "fill.cu", None),
           (CUDA + "ggml-cuda.cu", CUDA_FUSION), ("tests/test-backend-ops.cpp", CUDA_FUSION),
           (CUDA + "ggml-cuda.cu", None)]),
    Patch("0007-ggml-cuda-dsa-streams.patch",
          "ggml-cuda: concurrent streams for a DSA layer's decode branches\n\n"
          "graph_optimize forks a single-token DSA layer at attn_norm into Q, K, V and lightning-indexer branches (the\n"
          "indexer's stream created with the greatest priority; CUDA graphs instantiated with per-node priorities); without\n"
          "GGML_CUDA_GRAPH_OPT=1 only regions with a lightning indexer fork.\n",
          [(CUDA + "common.cuh", r"prio|GGML_USE_HIP"), (CUDA + "ggml-cuda.cu", CUDA_STREAMS)]),
    Patch("0008-ggml-backend-async-inputs.patch",
          "ggml-backend: the scheduler copies a split's host-memory user inputs asynchronously with one synchronization\n"
          "per split instead of a synchronous copy per input (not used with pipeline-parallel copy events).\n",
          [("ggml/src/ggml-backend.cpp", None)]),
    Patch("0009-llama-kv-cells-position-stamp.patch",
          "llama: a stamp of a KV cache's cell positions, new at every write of any position (a process-wide counter),\n"
          "and a read of every cell's position, so that a graph input derived from the positions can tell it is still\n"
          "valid.\n",
          [("src/llama-kv-cells.h", None)]),
    Patch("0010-llama-dsa-kv-cache.patch",
          "llama: KV cache of a lightning-indexer model: the indexer-key cache beside the main one, the ASQ compressed\n"
          "cache type and the cell-position inputs.\n",
          [("src/llama-kv-cache*", None),
           ("src/llama-model.cpp", r"llama_kv_cache_dsa|Llama-family file with a lightning indexer")]),
    Patch("0011-llama-dsa-graph.patch",
          "llama: the sparse attention graph for llama / qwen2 / qwen3\n\n"
          "The indexer, selection and attention paths (decode over the picks, prefill masked or over the picks at long\n"
          "context), masks computed in the graph, and a check of every DSA node on its device (a standard-op form, or\n"
          "one error, where a kernel does not cover the shape). Environment (read only for models with an indexer):\n"
          "LLAMA_DSA_FUSED, LLAMA_DSA_HOST_MASKS, LLAMA_DSA_GATHER (reference paths), LLAMA_DSA_HOST_TIMING,\n"
          "LLAMA_DSA_INDEXER_ONLY (measurements).\n",
          [("src/llama-graph.*", None), ("src/llama-context.*", None), ("src/llama-cparams.h", None), (MODELS, None),
           ("src/llama-model.cpp", None)]),
]


def git(tree: Path, *args: str, inp: str | None = None) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True,
                          input=inp).stdout


@dataclass
class Unit:
    path: str
    start: int            # first base line replaced (0-based), or the base line the insert goes before
    n_del: int
    lines: list[str]      # inserted lines
    text: str             # what the rules match: removed and inserted lines
    first_in_hunk: bool
    patch: int = -1


_TOP = re.compile(r"^(?![}#\s])\S")
_COND = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b")


def units_of(tree: Path, base: str, head: str, path: str) -> list[Unit]:
    diff = git(tree, "diff", "-U0", "--no-color", "--no-ext-diff", base, head, "--", path)
    out: list[Unit] = []
    for h in re.split(r"(?m)^(?=@@ )", diff)[1:]:
        rows = h.split("\n")
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", rows[0])
        a, b = int(m.group(1)), int(m.group(2) if m.group(2) is not None else 1)
        start = a if b == 0 else a - 1          # -a,0: insert after base line a
        dels = [r[1:] for r in rows[1:] if r.startswith("-")]
        ins = [r[1:] for r in rows[1:] if r.startswith("+")]
        if dels:
            out.append(Unit(path, start, b, ins, "\n".join(dels + ins), True))
            continue
        segs: list[list[str]] = [[]]
        indented_comment = path.endswith("test-backend-ops.cpp")
        for i, line in enumerate(ins):
            prev_blank = i > 0 and ins[i - 1].strip() == ""
            cond = _COND.match(line)
            if segs[-1] and (cond or _COND.match(segs[-1][-1]) or (prev_blank and (
                    _TOP.match(line) or (indented_comment and line.lstrip().startswith("//"))))):
                segs.append([])
            segs[-1].append(line)
        for j, s in enumerate(segs):
            out.append(Unit(path, start, 0, s, "\n".join(s), j == 0))
    return out


def assign(units: list[Unit]) -> list[Unit]:
    unclaimed = []
    conds: list[int] = []                   # patches of the open #if units of inserted code
    for i, u in enumerate(units):
        d = _COND.match(u.lines[0]) if u.n_del == 0 and len(u.lines) == 1 else None
        opens = d is not None and d.group(1) in ("if", "ifdef", "ifndef")
        if d and not opens and conds:
            u.patch = conds[-1]             # #else / #elif / #endif go with the #if they belong to
            if d.group(1) == "endif":
                conds.pop()
            continue
        for k, p in enumerate(SERIES):
            if any(fnmatch.fnmatch(u.path, g) and rx and re.search(rx, u.text, re.M) for g, rx in p.rules):
                u.patch = k
                break
        if u.patch >= 0:
            continue
        if not u.first_in_hunk and not _TOP.match(u.lines[0]):
            u.patch = units[i - 1].patch
            continue
        for k, p in enumerate(SERIES):
            if any(fnmatch.fnmatch(u.path, g) and rx is None for g, rx in p.rules):
                u.patch = k
                break
        if u.patch < 0:
            unclaimed.append(u)
        elif opens:
            conds.append(u.patch)
    if unclaimed:
        raise SystemExit("error: changes in no patch of the series: " +
                         ", ".join(f"{u.path}:{u.start + 1}" for u in unclaimed))
    return units


def tree_file(base_lines: list[str], units: list[Unit], upto: int) -> list[str]:
    """The file with the units of patches 0..upto applied."""
    out: list[str] = []
    pos = 0
    for u in units:                                      # in base order; inserts at one place keep their order
        out.extend(base_lines[pos:u.start])
        pos = max(pos, u.start)
        if u.patch <= upto:
            out.extend(u.lines)
            pos = u.start + u.n_del
        elif u.n_del:
            out.extend(base_lines[u.start:u.start + u.n_del])
            pos = u.start + u.n_del
    out.extend(base_lines[pos:])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", type=Path)
    ap.add_argument("--base", default="base")
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "patches" / "llama.cpp")
    ap.add_argument("--branch")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    status = git(a.tree, "diff", "--name-status", "--no-renames", a.base, a.head).split("\n")
    changed = [(s.split("\t")[0], s.split("\t")[1]) for s in status if s]
    files: dict[str, tuple[list[str], list[Unit]]] = {}
    for st, path in changed:
        base_text = "" if st == "A" else git(a.tree, "show", f"{a.base}:{path}")
        units = assign(units_of(a.tree, a.base, a.head, path))
        files[path] = (base_text.split("\n"), units)
        if a.list:
            for u in units:
                first = next((x for x in u.lines if x.strip()), u.text.split("\n")[0])
                print(f"{SERIES[u.patch].name[:4]} {path}:{u.start + 1} +{len(u.lines)} -{u.n_del}  {first.strip()[:90]}")
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "wt"
        git(a.tree, "worktree", "add", "--detach", "-q", str(wt), a.base)
        try:
            for k, p in enumerate(SERIES):
                for path, (base_lines, units) in files.items():
                    lines = tree_file(base_lines, units, k)
                    f = wt / path
                    if lines == [""] and not any(u.patch <= k for u in units):
                        if f.exists():
                            f.unlink()
                        continue
                    f.parent.mkdir(parents=True, exist_ok=True)
                    f.write_text("\n".join(lines))
                git(wt, "add", "-A")
                git(wt, "-c", "user.name=dsa", "-c", "user.email=dsa@localhost", "commit", "-q", "--allow-empty",
                    "-m", p.header)
            if git(wt, "diff", "--stat", a.head):
                raise SystemExit("error: the series does not reproduce HEAD")
            a.out.mkdir(parents=True, exist_ok=True)
            for old in a.out.glob("*.patch"):
                old.unlink()
            n = len(SERIES)
            for k, p in enumerate(SERIES):
                diff = git(wt, "diff", "--no-color", "--no-ext-diff", f"HEAD~{n - k}", f"HEAD~{n - k - 1}")
                if not diff:
                    raise SystemExit(f"error: {p.name}: no changes")
                (a.out / p.name).write_text(p.header + "\n" + diff)
                print(f"{p.name}: {sum(1 for x in diff.split(chr(10)) if x.startswith('+') and not x.startswith('+++'))} "
                      f"lines added")
            if a.branch:
                git(a.tree, "branch", "-f", a.branch, git(wt, "rev-parse", "HEAD").strip())
        finally:
            git(a.tree, "worktree", "remove", "--force", str(wt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
