"""Build llama-cpp-python from its sdist with the project's llama.cpp patches.

Steps: locate (or `pip download`) the sdist -> untar -> apply ``patches/llama.cpp/*.patch``
to ``vendor/llama.cpp`` -> ``pip wheel`` with ``CMAKE_ARGS`` (build dir kept) -> build the
vendored tools (llama-perplexity, llama-quantize, llama-imatrix, llama-bench, llama-passkey, llama-cli,
llama-server) in the same tree -> load a 1-layer model with the new wheel in a child process (load_check.py) ->
cache wheel + tools under a key of version + sdist hash + patch hash + flags + compiler environment.
A second build with the same key is a cache hit: only ``pip install`` of the cached wheel.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
VENDORED_LLAMA_CPP_COMMIT = "0c1e57098"
TOOLS = ("llama-perplexity", "llama-quantize", "llama-imatrix", "llama-bench", "llama-passkey", "llama-cli",
         "llama-server")
# the environment CMake's compilers and flags come from: a different compiler is a different build
TOOLCHAIN_ENV = ("CC", "CXX", "CUDAHOSTCXX", "CFLAGS", "CXXFLAGS", "LDFLAGS")
REPO_ROOT = Path(__file__).resolve().parents[2]
PATCH_DIR = REPO_ROOT / "patches" / "llama.cpp"


class BuildError(RuntimeError):
    """A backend build step failed; the message says which."""


def cache_root() -> Path:
    return Path(os.environ.get("DSA_CACHE", Path.home() / ".cache" / "dsa"))


@dataclass
class BuildConfig:
    cuda: bool = False
    cuda_arch: str = "90"
    jobs: int = max(1, os.cpu_count() or 1)
    extra_cmake_args: list[str] = field(default_factory=list)
    sdist: Path | None = None
    # ggml's AMX weight buffers (chosen automatically for Q4_0/Q8_0 on CPUs that advertise AMX)
    # segfault on this project's x86 VMs, in the stock tree too (llama-perplexity on a Q4_0 file:
    # SIGSEGV; with --no-repack: fine). Off unless asked for; AVX-512/AVX2 paths stay native.
    amx: bool = False
    build_isolation: bool = True   # False on offline machines that already have scikit-build-core
    op_tests: bool = False         # also build llama.cpp's test-backend-ops (the ops of every backend against the CPU)

    def tools(self) -> tuple[str, ...]:
        return TOOLS + (("test-backend-ops",) if self.op_tests else ())

    def cmake_args(self) -> list[str]:
        args = [
            "-DLLAVA_BUILD=OFF",  # multimodal library not needed; saves build time
            "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_SERVER=ON",      # llama-server and llama-cli (`dsa serve`)
            "-DLLAMA_BUILD_UI=OFF",         # the server's web UI: npm, or a download at build time; the API needs neither
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DLLAMA_OPENSSL=OFF",          # plain HTTP on loopback; no libssl needed to build
            "-DLLAMA_BUILD_APP=OFF",
            f"-DLLAMA_BUILD_TESTS={'ON' if self.op_tests else 'OFF'}",
            "-DLLAMA_BUILD_EXAMPLES=ON",   # llama-passkey (examples/passkey): the upstream long-context client
        ]
        if self.cuda:
            args += ["-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_arch}"]
        if not self.amx and platform.machine() in ("x86_64", "AMD64"):
            no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
            args += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
        return args + list(self.extra_cmake_args)


def patch_files() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch")) if PATCH_DIR.is_dir() else []


def patch_hash() -> str:
    h = hashlib.sha256()
    for p in patch_files():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16] if patch_files() else "none"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_sdist(cfg: BuildConfig) -> Path:
    """The sdist given, one in the cache, or one fetched from PyPI into the cache."""
    if cfg.sdist is not None:
        if not cfg.sdist.is_file():
            raise BuildError(f"sdist not found: {cfg.sdist}")
        return cfg.sdist
    d = cache_root() / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if (d / name).is_file():
        return d / name
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(d)]
    if subprocess.run(cmd).returncode != 0 or not (d / name).is_file():
        raise BuildError(f"could not download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist from PyPI")
    return d / name


def build_key(cfg: BuildConfig, sdist: Path) -> str:
    ident = {
        "version": LLAMA_CPP_PYTHON_VERSION,
        "sdist_sha256": _sha256_file(sdist),
        "patch": patch_hash(),
        "cmake_args": cfg.cmake_args(),
        "machine": platform.machine(),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    toolchain = {k: os.environ[k] for k in TOOLCHAIN_ENV if os.environ.get(k)}
    if toolchain:   # absent when unset, so builds with the default compiler keep their earlier keys
        ident["toolchain"] = toolchain
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return f"{LLAMA_CPP_PYTHON_VERSION}-{'cuda' if cfg.cuda else 'cpu'}-{digest}"


def backend_dir(key: str) -> Path:
    return cache_root() / "backend" / key


def _run(cmd: list[str], log, cwd: Path | None = None, env: dict | None = None) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise BuildError(f"command failed (exit {rc}): {' '.join(cmd[:4])} … — see {log.name}")


def apply_patches(src: Path, log) -> None:
    for p in patch_files():
        _run(["patch", "-p1", "--forward", "--batch", "-i", str(p)], log, cwd=src / "vendor" / "llama.cpp")


def build(cfg: BuildConfig, install: bool = True, say=print) -> Path:
    """Build (or take from cache) the patched backend; returns its cache directory."""
    sdist = find_sdist(cfg)
    key = build_key(cfg, sdist)
    out = backend_dir(key)
    if not (out / "build.json").is_file():
        _build_into(cfg, sdist, key, out, say)
    else:
        say(f"backend cache hit: {out}")
    if install:
        wheel = next(out.glob("wheel/*.whl"))
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", "-q", str(wheel)]
        if subprocess.run(cmd).returncode != 0:
            raise BuildError(f"pip install of {wheel.name} failed")
        _ensure_runtime_deps()
        current = cache_root() / "backend" / "current"
        tmp = current.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(out)
        os.replace(tmp, current)
    return out


def _ensure_runtime_deps() -> None:
    try:
        import diskcache  # noqa: F401
        import jinja2  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "diskcache>=5.6.1", "jinja2>=2.11.3"])


def copy_shared_libs(src: Path, dst: Path) -> None:
    """Every ``*.so*`` under *src* into *dst* (the first of a name wins). A version link (libggml.so -> libggml.so.0 ->
    libggml.so.0.25.3, a link to a name in its own folder) stays a link, so each library is stored once: the CUDA
    library is the cache entry's largest file, and the entry travels to GPU machines as a tarball."""
    for so in sorted(src.rglob("*.so*")):
        out = dst / so.name
        if out.exists() or out.is_symlink() or not so.exists():
            continue
        target = os.readlink(so) if so.is_symlink() else None
        if target is not None and "/" not in target:
            out.symlink_to(target)
        elif so.is_file():
            shutil.copy2(so, out)


def _build_into(cfg: BuildConfig, sdist: Path, key: str, out: Path, say) -> None:
    cache_root().mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"dsa-backend-{key}-", dir=cache_root()))
    log_path = cache_root() / "backend" / f"{key}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"building llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (patch {patch_hash()}, "
        f"{'CUDA' if cfg.cuda else 'CPU'}) — log: {log_path}")
    try:
        with open(log_path, "w") as log:
            staging = _build_stage(cfg, sdist, key, work, log, say)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, out)  # atomic publish: a killed build never leaves a half cache entry
    finally:
        shutil.rmtree(work, ignore_errors=True)     # built or failed, the build tree goes; the log stays
    say(f"backend built: {out}")


def _build_stage(cfg: BuildConfig, sdist: Path, key: str, work: Path, log, say) -> Path:
    """Untar the sdist into *work*, patch it, build the wheel and the tools and check that the wheel loads; returns
    the staging folder that becomes the cache entry."""
    with tarfile.open(sdist) as tf:
        tf.extractall(work, filter="data")
    src = next(p for p in work.iterdir() if p.is_dir())
    apply_patches(src, log)
    env = dict(os.environ)
    env["CMAKE_ARGS"] = " ".join(shlex.quote(a) for a in cfg.cmake_args())
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(cfg.jobs)
    bdir = work / "build"
    staging = work / "stage"
    (staging / "wheel").mkdir(parents=True)
    iso = [] if cfg.build_isolation else ["--no-build-isolation"]
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *iso, "-w", str(staging / "wheel"),
          "-C", f"build-dir={bdir}", str(src)], log, env=env)
    _run(["cmake", "--build", str(bdir), "-j", str(cfg.jobs), "--target", *cfg.tools()], log, env=env)
    bin_dir = staging / "bin"
    bin_dir.mkdir()
    for t in cfg.tools():
        hits = list(bdir.rglob(t))
        exe = next((h for h in hits if h.is_file() and os.access(h, os.X_OK)), None)
        if exe is None:
            raise BuildError(f"tool {t} was not built")
        shutil.copy2(exe, bin_dir / t)
    copy_shared_libs(bdir, bin_dir)
    _load_check(cfg, next((staging / "wheel").glob("*.whl")), work, log, say)
    meta = {"key": key, "version": LLAMA_CPP_PYTHON_VERSION, "llama_cpp_commit": VENDORED_LLAMA_CPP_COMMIT,
            "patch_hash": patch_hash(), "patches": [p.name for p in patch_files()],
            "cuda": cfg.cuda, "cmake_args": cfg.cmake_args(), "tools": list(cfg.tools())}
    (staging / "build.json").write_text(json.dumps(meta, indent=2))
    return staging


def _load_check(cfg: BuildConfig, wheel: Path, work: Path, log, say) -> None:
    """Unpack the wheel and load a 1-layer model with it in a child process (load_check.py). A CUDA build is checked
    on its GPU, so only where one is visible; elsewhere the check is skipped with a line that says so."""
    if cfg.cuda and shutil.which("nvidia-smi") is None:
        say("load check skipped: a CUDA build and no GPU on this machine")
        return
    from .load_check import LoadCheckFailed, run_load_check, write_check_model   # numpy and gguf: only when building

    site = work / "check-site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    model = work / "check.gguf"
    write_check_model(model)
    _ensure_runtime_deps()      # what `pip install` of the wheel would bring; the child imports llama_cpp whole
    try:
        run_load_check(site, model, 99 if cfg.cuda else 0, log)
    except LoadCheckFailed as e:
        raise BuildError(f"{e}; the compilers were {_compilers(cfg)} — see {log.name}") from None


def _compilers(cfg: BuildConfig) -> str:
    """The C++ compilers a build used, for its error line (CUDAHOSTCXX links the CUDA library)."""
    names = ("CXX", "CUDAHOSTCXX") if cfg.cuda else ("CXX",)
    return ", ".join(f"{n}={os.environ.get(n, 'default')}" for n in names)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--amx", action="store_true", help="keep ggml's AMX CPU buffers (off by default)")
    ap.add_argument("--no-install", action="store_true")
    ap.add_argument("--sdist", type=Path)
    a = ap.parse_args(argv)
    try:
        build(BuildConfig(cuda=a.cuda, sdist=a.sdist, amx=a.amx), install=not a.no_install)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
