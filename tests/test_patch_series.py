"""scripts/write_patch_series.py: a patched tree's change cut into one patch per feature, each prefix applying in order,
the whole series giving HEAD exactly; a change no rule claims is an error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import write_patch_series as wps  # noqa: E402


def git(d: Path, *a: str) -> str:
    return subprocess.run(["git", "-C", str(d), "-c", "user.name=t", "-c", "user.email=t@t", *a], check=True,
                          capture_output=True, text=True).stdout


@pytest.fixture
def tree(tmp_path):
    d = tmp_path / "tree"
    d.mkdir()
    git(d, "init", "-q")
    (d / "ops.c").write_text("int a(void) {\n    return 1;\n}\n\nint b(void) {\n    return 2;\n}\n")
    git(d, "add", "-A")
    git(d, "commit", "-qm", "base")
    git(d, "tag", "base")
    # HEAD: one hunk adding two top-level items (the second for patch 2), a changed line, a new file
    (d / "ops.c").write_text("int a(void) {\n    return 1;\n}\n\nint sel(void) {\n    return 3;\n}\n\n"
                             "int fast_sel(void) {\n    return 4;\n}\n\nint b(void) {\n    return 20;\n}\n")
    (d / "new.h").write_text("int fast_sel(void);\n")
    git(d, "add", "-A")
    git(d, "commit", "-qm", "head")
    return d


def series(extra_rules=()):
    return [wps.Patch("0001-core.patch", "core\n", [("ops.c", None), *extra_rules]),
            wps.Patch("0002-fast.patch", "fast\n", [("ops.c", r"fast_sel"), ("new.h", None)])]


def test_units_go_to_their_patches_and_the_prefixes_build_head(tree, tmp_path, monkeypatch):
    monkeypatch.setattr(wps, "SERIES", series())
    out = tmp_path / "out"
    assert wps.main([str(tree), "--out", str(out), "--branch", "s"]) == 0
    p1, p2 = (out / "0001-core.patch").read_text(), (out / "0002-fast.patch").read_text()
    assert p1.startswith("core\n") and "+int sel(void)" in p1 and "+    return 20;" in p1 and "fast_sel" not in p1
    added2 = [ln for ln in p2.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert "+int fast_sel(void) {" in added2 and "+int fast_sel(void);" in added2 and "+int sel(void) {" not in added2
    # the branch's first commit is base + patch 1; applying both patches to a pristine copy gives HEAD
    assert "fast_sel" not in git(tree, "show", "s~1:ops.c") and "int sel" in git(tree, "show", "s~1:ops.c")
    fresh = tmp_path / "fresh"
    git(tree, "worktree", "add", "-q", "--detach", str(fresh), "base")
    for p in (out / "0001-core.patch", out / "0002-fast.patch"):
        subprocess.run(["patch", "-p1", "--batch", "-s", "-i", str(p)], cwd=fresh, check=True)
    assert (fresh / "ops.c").read_text() == (tree / "ops.c").read_text()
    assert (fresh / "new.h").read_text() == (tree / "new.h").read_text()


def test_a_change_no_rule_claims_is_an_error(tree, tmp_path, monkeypatch):
    monkeypatch.setattr(wps, "SERIES", [wps.Patch("0001-core.patch", "core\n", [("ops.c", None)])])
    with pytest.raises(SystemExit, match="changes in no patch of the series: new.h"):
        wps.main([str(tree), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_an_if_block_split_over_patches_keeps_its_else_and_endif_with_the_if(tmp_path, monkeypatch):
    d = tmp_path / "tree"
    d.mkdir()
    git(d, "init", "-q")
    (d / "k.cu").write_text("int a;\n")
    git(d, "add", "-A")
    git(d, "commit", "-qm", "base")
    git(d, "tag", "base")
    (d / "k.cu").write_text("int a;\n#if !defined(HIP)\nint core(void) { return 1; }\n\nint fast_sel(void) { return 2; }\n"
                            "#else\nint core(void) { return 0; }\n\nint fast_sel(void) { return 0; }\n#endif\n")
    git(d, "commit", "-qam", "head")
    monkeypatch.setattr(wps, "SERIES", [wps.Patch("0001-core.patch", "core\n", [("k.cu", None)]),
                                        wps.Patch("0002-fast.patch", "fast\n", [("k.cu", r"fast_sel")])])
    assert wps.main([str(d), "--out", str(tmp_path / "out"), "--branch", "s"]) == 0
    first = git(d, "show", "s~1:k.cu")
    assert "fast_sel" not in first and first.count("#if") == first.count("#endif") == 1 and "#else" in first
