"""The backend cache entry: shared libraries stored once, version links kept as links; what its key holds (the
op-tests option, the compiler environment); the build's load check on the built wheel; what a failed build leaves."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import requires_backend

from dsa_convert.backend.build import copy_shared_libs


def test_version_links_stay_links_and_each_library_is_copied_once(tmp_path):
    build = tmp_path / "build"
    (build / "ggml" / "src").mkdir(parents=True)
    (build / "bin").mkdir()
    real = build / "ggml" / "src" / "libggml-cuda.so.0.25.3"
    real.write_bytes(b"\x7fELF" + b"x" * 4096)
    os.symlink("libggml-cuda.so.0.25.3", build / "ggml" / "src" / "libggml-cuda.so.0")
    os.symlink("libggml-cuda.so.0", build / "ggml" / "src" / "libggml-cuda.so")
    os.symlink(str(real), build / "bin" / "libabs.so")              # a link by absolute path: copied as a file
    (build / "bin" / "libggml-cuda.so.0.25.3").write_bytes(b"other")  # the same name elsewhere: the first wins
    os.symlink("libgone.so.1", build / "bin" / "libgone.so")          # dangling: skipped
    out = tmp_path / "out"
    out.mkdir()
    copy_shared_libs(build, out)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["libabs.so", "libggml-cuda.so", "libggml-cuda.so.0", "libggml-cuda.so.0.25.3"]
    assert os.readlink(out / "libggml-cuda.so") == "libggml-cuda.so.0"
    assert os.readlink(out / "libggml-cuda.so.0") == "libggml-cuda.so.0.25.3"
    assert not (out / "libggml-cuda.so.0.25.3").is_symlink()
    assert not (out / "libabs.so").is_symlink() and (out / "libabs.so").read_bytes() == real.read_bytes()
    # every link resolves inside the folder, to the one copy (the first found in sorted order: build/bin's)
    assert (out / "libggml-cuda.so").read_bytes() == (out / "libggml-cuda.so.0.25.3").read_bytes() == b"other"
    assert sum(1 for p in out.iterdir() if not p.is_symlink()) == 2


def test_op_tests_build_adds_test_backend_ops_and_changes_the_cache_key(tmp_path):
    from dsa_convert.backend.build import TOOLS, BuildConfig, build_key

    plain, with_tests = BuildConfig(), BuildConfig(op_tests=True)
    assert plain.tools() == TOOLS and "-DLLAMA_BUILD_TESTS=OFF" in plain.cmake_args()
    assert with_tests.tools() == TOOLS + ("test-backend-ops",) and "-DLLAMA_BUILD_TESTS=ON" in with_tests.cmake_args()
    sdist = tmp_path / "x.tar.gz"
    sdist.write_bytes(b"sdist")
    assert build_key(plain, sdist) != build_key(with_tests, sdist)


def test_compiler_environment_changes_the_cache_key(tmp_path, monkeypatch):
    from dsa_convert.backend.build import TOOLCHAIN_ENV, BuildConfig, build_key

    sdist = tmp_path / "x.tar.gz"
    sdist.write_bytes(b"sdist")
    for k in TOOLCHAIN_ENV:
        monkeypatch.delenv(k, raising=False)
    plain = build_key(BuildConfig(), sdist)
    monkeypatch.setenv("CXX", "/opt/gcc/bin/g++")
    other = build_key(BuildConfig(), sdist)
    monkeypatch.setenv("CXX", "")
    assert plain != other and build_key(BuildConfig(), sdist) == plain


def _built_wheel() -> Path:
    from dsa_convert.backend.runtime import current_build

    return next((current_build() / "wheel").glob("*.whl"))


@requires_backend
def test_load_check_passes_with_the_built_wheel(tmp_path):
    import io

    from dsa_convert.backend.build import BuildConfig, _load_check

    log = io.StringIO()
    _load_check(BuildConfig(), _built_wheel(), tmp_path, log, print)
    assert "load check: decoded 5 tokens with " + str(tmp_path / "check-site") in log.getvalue()


@requires_backend
def test_load_check_reports_a_model_the_library_cannot_load(tmp_path):
    import io
    import zipfile

    from dsa_convert.backend.load_check import LoadCheckFailed, run_load_check, write_check_model

    with zipfile.ZipFile(_built_wheel()) as z:
        z.extractall(tmp_path / "site")
    model = tmp_path / "check.gguf"
    write_check_model(model)
    model.write_bytes(model.read_bytes()[:4096])     # header and vocabulary cut off
    with pytest.raises(LoadCheckFailed, match=r"loading a 1-layer model failed \(exit 1\): ValueError: Failed to load"):
        run_load_check(tmp_path / "site", model, 0, io.StringIO())


def test_a_failed_build_keeps_its_log_and_removes_its_build_tree(tmp_path, monkeypatch):
    """An sdist whose vendored llama.cpp the patches do not fit: the build stops at the first patch with one line,
    publishes no cache entry and leaves only the log behind."""
    import tarfile

    from dsa_convert.backend.build import BuildConfig, BuildError, build

    src = tmp_path / "llama_cpp_python-0.0.0" / "vendor" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "README.md").write_text("not llama.cpp\n")
    sdist = tmp_path / "fake.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        tf.add(tmp_path / "llama_cpp_python-0.0.0", arcname="llama_cpp_python-0.0.0")
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSA_CACHE", str(cache))
    with pytest.raises(BuildError, match=r"command failed \(exit \d+\): patch -p1"):
        build(BuildConfig(sdist=sdist), install=False, say=lambda _: None)
    left = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*"))
    assert len(left) == 2 and left[0] == "backend" and left[1].startswith("backend/") and left[1].endswith(".log")


def test_a_failed_check_names_the_compilers_that_linked_the_libraries(monkeypatch):
    from dsa_convert.backend.build import BuildConfig, _compilers

    monkeypatch.setenv("CXX", "/usr/bin/g++")
    monkeypatch.setenv("CUDAHOSTCXX", "/opt/gcc/bin/g++")
    assert _compilers(BuildConfig()) == "CXX=/usr/bin/g++"
    assert _compilers(BuildConfig(cuda=True)) == "CXX=/usr/bin/g++, CUDAHOSTCXX=/opt/gcc/bin/g++"
    monkeypatch.delenv("CUDAHOSTCXX")
    assert _compilers(BuildConfig(cuda=True)) == "CXX=/usr/bin/g++, CUDAHOSTCXX=default"
