"""One `dsa bench --variant` run in a process of its own: `python -m dsa_convert.eval.variant_proc RESULT` with the
pickled job (path, ctx, options, file info, variant) on stdin and the variant's switch already in the environment.

llama.cpp's libraries are loaded before anything imports numpy (backend.runtime.preload_llama_cpp: with a CUDA library
that carries its own libstdc++ the other order segfaults inside llama_model_load), so this module imports nothing of
the project at module level, and the job is unpickled (which imports eval.bench and numpy) only after the preload.
Writes ("row", dict) or ("error", one line), pickled, to RESULT. The parent (eval.bench._run_variant) starts it with
SIGINT ignored, so a terminal's Ctrl-C to the process group leaves it to the parent, which stops it.
"""
from __future__ import annotations

import os
import pickle
import sys


def main(result: str) -> int:
    from ..backend.runtime import import_llama_cpp, preload_llama_cpp

    preload_llama_cpp()
    try:
        path, ctx_len, o, fi, variant = pickle.load(sys.stdin.buffer)
        from .bench import run_one

        msg = ("row", run_one(import_llama_cpp(), path, ctx_len, "sparse", o, fi, variant))
    except Exception as e:  # noqa: BLE001 - any failure becomes the row's error line in the parent
        msg = ("error", str(e).splitlines()[0] if str(e) else repr(e))
    tmp = result + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(msg, f)
    os.replace(tmp, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
