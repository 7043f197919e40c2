"""Bad input to `dsa convert`: one-line error, non-zero exit, no OUT file, no traceback."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_tiny_model

EXIT_BAD_INPUT = 3


def run_dsa(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsa_convert.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_clean_failure(r: subprocess.CompletedProcess, out: Path, needle: str, code: int = EXIT_BAD_INPUT):
    lines = r.stderr.strip().splitlines()
    err = [ln for ln in lines if ln.startswith("error: ")]
    assert r.returncode == code, (r.returncode, r.stderr)
    assert len(err) == 1 and lines[-1] == err[0], r.stderr   # warnings may precede; one error line, last
    assert needle.lower() in err[0].lower(), err[0]
    assert "Traceback" not in r.stderr
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


@pytest.fixture(scope="module")
def good_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("good") / "m", "llama-llama3rope-tied-sharded")


@pytest.fixture
def model(good_model, tmp_path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(good_model, d)
    return d


def test_good_model_converts(model, tmp_path):
    out = tmp_path / "ok.gguf"
    r = run_dsa("convert", str(model), str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tensors"] > 0 and out.is_file()


def test_missing_model_dir(tmp_path):
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(tmp_path / "nope"), str(out)), out, "not found")


def test_missing_config(model, tmp_path):
    (model / "config.json").unlink()
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out)), out, "no config.json")


def test_unknown_architecture(model, tmp_path):
    c = json.loads((model / "config.json").read_text())
    c["architectures"] = ["GPTNeoXForCausalLM"]
    (model / "config.json").write_text(json.dumps(c))
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out)), out, "unsupported architecture 'GPTNeoXForCausalLM'")


def test_truncated_shard(model, tmp_path):
    shard = sorted(model.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out)), out, "truncated")


def test_shard_missing_from_disk(model, tmp_path):
    shard = sorted(model.glob("model-*.safetensors"))[0]
    shard.unlink()
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out)), out, "missing")


def test_tensor_missing_from_index(model, tmp_path):
    idx = json.loads((model / "model.safetensors.index.json").read_text())
    victim = next(k for k in idx["weight_map"] if "k_proj" in k)
    shard = model / idx["weight_map"].pop(victim)
    from safetensors.torch import load_file, save_file

    tensors = load_file(shard)
    tensors.pop(victim)
    save_file(tensors, shard, metadata={"format": "pt"})
    (model / "model.safetensors.index.json").write_text(json.dumps(idx))
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out)), out, "missing")


def test_shard_index_points_outside(model, tmp_path):
    idx = json.loads((model / "model.safetensors.index.json").read_text())
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k] = "../../etc/passwd"
    (model / "model.safetensors.index.json").write_text(json.dumps(idx))
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out)), out, "outside the model directory")


def test_no_tokenizer(model, tmp_path):
    (model / "tokenizer.json").unlink()
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out)), out, "no tokenizer")


def test_out_exists_without_force(model, tmp_path):
    out = tmp_path / "o.gguf"
    out.write_bytes(b"precious")
    r = run_dsa("convert", str(model), str(out))
    assert r.returncode == EXIT_BAD_INPUT and "--force" in r.stderr and "Traceback" not in r.stderr
    assert out.read_bytes() == b"precious"
    r = run_dsa("convert", str(model), str(out), "--force")
    assert r.returncode == 0 and out.read_bytes()[:4] == b"GGUF"


def test_out_dir_not_writable(model, tmp_path):
    if os.geteuid() == 0:  # root ignores mode bits: use a directory the kernel refuses
        out_dir = Path("/sys")
    else:
        out_dir = tmp_path / "ro"
        out_dir.mkdir()
        out_dir.chmod(0o500)
    out = out_dir / "o.gguf"
    r = run_dsa("convert", str(model), str(out))
    assert r.returncode == EXIT_BAD_INPUT and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "writ" in r.stderr or "permission" in r.stderr.lower()
    assert not out.exists()


def test_out_dir_missing(model, tmp_path):
    out = tmp_path / "no" / "such" / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out)), out, "does not exist")


def test_nan_weights(model, tmp_path):
    from safetensors.torch import load_file, save_file

    shard = sorted(model.glob("model-*.safetensors"))[0]
    t = load_file(shard)
    k = next(iter(t))
    t[k][0] = float("nan")
    save_file(t, shard, metadata={"format": "pt"})
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out)), out, "NaN")


def test_unknown_outtype(model, tmp_path):
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out), "--outtype", "q3_k"), out, "outtype")
