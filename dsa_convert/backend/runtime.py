"""Find and describe the installed llama.cpp backend (llama-cpp-python + the vendored tools)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import DsaError
from .build import LLAMA_CPP_PYTHON_VERSION, cache_root, patch_hash

SPARSE_MARKER = b"sparse attention: top-k="


class BackendMissing(DsaError):
    pass


def child_python_env(extra: dict | None = None) -> dict:
    """The environment of a child `python -m dsa_convert...`: this one's, with the directory holding the dsa_convert
    package first on PYTHONPATH (children that must load llama.cpp before numpy, or must not load it at all)."""
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, **(extra or {}),
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


def import_llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError) as e:
        raise BackendMissing(f"llama.cpp backend not installed ({e.__class__.__name__}); "
                             "run `dsa backend build` (or scripts/install.sh)") from None
    return llama_cpp


def preload_llama_cpp() -> None:
    """Load llama.cpp's libraries before numpy or torch are imported, when the backend is installed.

    A CUDA build whose libggml-cuda carries its own copy of libstdc++ (nvcc linked it with a host compiler that
    links libstdc++ statically) segfaults inside llama_model_load in a process that loaded libstdc++ before
    llama_cpp, as importing numpy, torch or gguf does; the reverse order works. `dsa backend build` refuses such a
    build (load_check.py); loading llama_cpp first keeps one built before that check working. Entry points that will
    run llama.cpp call this first."""
    try:
        import_llama_cpp()
    except BackendMissing:
        pass


def current_build() -> Path | None:
    cur = cache_root() / "backend" / "current"
    return cur.resolve() if (cur / "build.json").is_file() else None


def build_record(build: Path) -> dict:
    """A backend build's record (build.json: version, patch hash, flags, tools, cuda)."""
    return json.loads((build / "build.json").read_text())


def tool_path(name: str) -> tuple[Path, dict]:
    """Path of a vendored tool (llama-perplexity, llama-quantize, …) and the env to run it."""
    cur = current_build()
    if cur is None or not (cur / "bin" / name).is_file():
        raise BackendMissing(f"{name} not found; run `dsa backend build`")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(cur / "bin") + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return cur / "bin" / name, env


def _lib_dir(llama_cpp) -> Path:
    return Path(llama_cpp.__file__).parent / "lib"


def backend_info() -> dict:
    d: dict = {"expected_version": LLAMA_CPP_PYTHON_VERSION, "repo_patch_hash": patch_hash()}
    try:
        lc = import_llama_cpp()
    except BackendMissing as e:
        d["installed"] = False
        d["error"] = str(e)
        return d
    d["installed"] = True
    d["version"] = getattr(lc, "__version__", "?")
    lib = _lib_dir(lc)
    libs = sorted(p.name for p in lib.glob("*.so*")) if lib.is_dir() else []
    d["cuda"] = any("ggml-cuda" in n for n in libs)
    d["gpu_offload"] = bool(lc.llama_supports_gpu_offload())
    so = next((p for p in lib.glob("libllama.so*")), None)
    d["sparse_attention"] = bool(so and SPARSE_MARKER in so.read_bytes())
    cur = current_build()
    if cur is not None:
        meta = build_record(cur)
        d["build"] = str(cur)
        d["build_patch_hash"] = meta.get("patch_hash")
        d["patches"] = meta.get("patches")
        d["tools"] = meta.get("tools")
        # the installed package must carry this build's library (a stale wheel from an older patch can stay
        # installed in an environment that `dsa backend build` did not install into)
        d["installed_is_build"] = _installed_from_wheel(so, cur / "wheel")
        d["patch_up_to_date"] = meta.get("patch_hash") == patch_hash() and d["installed_is_build"]
    return d


def _installed_from_wheel(so: Path | None, wheel_dir: Path) -> bool:
    """True if the installed libllama.so is the one in the build's cached wheel (size and CRC-32)."""
    import zipfile
    import zlib

    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if so is None or not wheels:
        return False
    data = so.resolve().read_bytes()
    with zipfile.ZipFile(wheels[0]) as z:
        for info in z.infolist():
            if info.filename.endswith("/" + so.name) and info.file_size == len(data):
                return info.CRC == zlib.crc32(data)
    return False
