"""The backend cache entry: shared libraries stored once, version links kept as links; the op-tests build option."""
from __future__ import annotations

import os

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
