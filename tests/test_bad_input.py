"""Bad-input campaign: corrupt GGUF / safetensors files, hostile headers, NaN/Inf weights, hostile shard
indexes, unwritable output, full disks. Every case must end in a one-line `error:` on stderr and a
non-zero exit — never a traceback, a hang or a half-written output file.

Files are crafted byte by byte (struct) so the cases do not depend on a writer accepting them.
Run: python -m pytest tests/test_bad_input.py -q      (results: docs/RESULTS.md, section 5)
"""
from __future__ import annotations

import errno
import json
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_model

from dsa_convert.errors import BadInputError
from dsa_convert.formats.gguf_read import GgufFile

EXIT_BAD_INPUT = 3
TIMEOUT = 120          # a case that takes longer counts as a hang


def run_dsa(*args: str, timeout: int = TIMEOUT, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsa_convert.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def assert_one_line_error(r: subprocess.CompletedProcess, code: int = EXIT_BAD_INPUT, needle: str = ""):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), r.stderr[-3000:]
    assert sum(ln.startswith("error: ") for ln in lines) == 1, r.stderr[-3000:]
    assert "internal error" not in lines[-1], lines[-1]
    assert needle.lower() in lines[-1].lower(), lines[-1]


def assert_no_output(out: Path):
    assert not out.exists(), f"{out} was written"
    assert not list(out.parent.glob(f".{out.name}.partial-*")), "partial temp file left behind"


# ---------------------------------------------------------------- GGUF crafting
def _s(b: bytes | str) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def craft_gguf(kvs: list[bytes] | None = None, infos: list[bytes] | None = None, data: bytes = b"",
               n_tensors: int | None = None, n_kv: int | None = None, version: int = 3,
               magic: bytes = b"GGUF", align: int = 32) -> bytes:
    """A GGUF by hand: header, raw KV records, raw tensor infos, padding, data."""
    kvs = [kv_str("general.architecture", "llama")] if kvs is None else kvs
    infos = [] if infos is None else infos
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    pad = (-len(body)) % align
    return body + b"\0" * pad + data


def kv_str(key: str, val: bytes | str) -> bytes:
    return _s(key) + struct.pack("<I", 8) + _s(val)


def kv_u32(key: str, v: int) -> bytes:
    return _s(key) + struct.pack("<II", 4, v)


def kv_array(key: str, itype: int, count: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<IIQ", 9, itype, count) + payload


def tensor_info(name: str | bytes, dims: list[int], qtype: int = 0, offset: int = 0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", qtype, offset)


def make_small_gguf(path: Path) -> Path:
    """A valid small GGUF (gguf-py writer): strings, arrays, F32/F16/Q8_0/Q4_0 tensors; < 1 KiB."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "a", "b", "\u00e9"])
    w.add_array("test.ints", [1, 2, 3])
    w.add_float32("test.f", 0.5)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((2, 8)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 8)).astype(np.float16))
    for name, qt, shape in (("q8", gguf.GGMLQuantizationType.Q8_0, (2, 32)), ("q4", gguf.GGMLQuantizationType.Q4_0, (1, 32))):
        q = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), qt)
        w.add_tensor(name, q, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read_everything(path: Path) -> None:
    """The whole GgufFile read path: open, every key's value, every tensor dequantized."""
    g = GgufFile(path)
    for k in g.keys():
        g.get(k)
    _ = g.arch
    for name in list(g.tensors):
        g.tensor(name)
    g.close()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> bytes:
    p = make_small_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf")
    read_everything(p)  # the baseline is valid
    return p.read_bytes()


F32_16 = np.arange(16, dtype=np.float32).tobytes()


def _gguf_cases(good: bytes) -> dict[str, bytes]:
    flip = lambda b, i, bit=0: b[:i] + bytes([b[i] ^ (1 << bit)]) + b[i + 1:]   # noqa: E731
    return {
        "zero-length": b"",
        "3 bytes": b"GGU",
        "wrong magic": b"GGML" + good[4:],
        "wrong magic (safetensors file)": struct.pack("<Q", 2) + b"{}",
        "text file": b"hello, this is not a model\n" * 10,
        "truncated header": good[:20],
        "truncated in KV section": good[:120],
        "truncated in tensor infos": good[: good.find(b"q8") + 4],
        "truncated in tensor data": good[:-40],
        "bit flip in version": flip(good, 4, 3),
        "bit flip high in tensor count": flip(good, 8 + 7, 7),
        "bit flip high in kv count": flip(good, 16 + 7, 7),
        "unsupported version 99": good[:4] + struct.pack("<I", 99) + good[8:],
        "tensor count 2^63": craft_gguf(n_tensors=2**63),
        "kv count 2^64-1": craft_gguf(n_kv=2**64 - 1),
        "key length 2^62": craft_gguf(kvs=[struct.pack("<Q", 2**62) + b"general.architecture"]),
        "string value length past EOF": craft_gguf(kvs=[_s("general.architecture") + struct.pack("<IQ", 8, 10**9) + b"llama"]),
        "uint8 array of 2^32 items at EOF": craft_gguf(kvs=[kv_str("general.architecture", "llama"),
                                                            kv_array("x.a", 0, 2**32, b"")]),
        "string array of 2^40 items": craft_gguf(kvs=[kv_str("general.architecture", "llama"),
                                                      kv_array("tokenizer.ggml.tokens", 8, 2**40, _s("a"))]),
        "nested array bomb": craft_gguf(kvs=[kv_array("x.a", 9, 2**30, struct.pack("<IQ", 9, 2**30) * 4)]),
        # found by the random sweep: gguf-py looped 108 s and grew to 7.9 GB RSS on this before the pre-scan
        "sweep case 2937 (u64 2^63 at byte 322)": good[:322] + struct.pack("<Q", 2**63) + good[330:],
        "unknown value type 77": craft_gguf(kvs=[_s("x.k") + struct.pack("<I", 77) + b"\0" * 8]),
        "invalid UTF-8 architecture": craft_gguf(kvs=[kv_str("general.architecture", b"\xff\xfe\xfd")]),
        "alignment 0": craft_gguf(kvs=[kv_str("general.architecture", "llama"), kv_u32("general.alignment", 0)]),
        "alignment 3": craft_gguf(kvs=[kv_str("general.architecture", "llama"), kv_u32("general.alignment", 3)]),
        "duplicate key": craft_gguf(kvs=[kv_str("general.architecture", "llama")] * 2),
        "missing general.architecture": craft_gguf(kvs=[kv_str("general.name", "x")]),
        "tensor claims 2^40 x 2^20 elements": craft_gguf(infos=[tensor_info("w", [2**40, 2**20])], data=F32_16),
        "tensor dims overflow uint64 product": craft_gguf(infos=[tensor_info("w", [2**32, 2**32, 2])], data=F32_16),
        "tensor offset past end": craft_gguf(infos=[tensor_info("w", [16], 0, 2**40)], data=F32_16),
        "tensor offset 2^64-32 (wraps)": craft_gguf(infos=[tensor_info("w", [16], 0, 2**64 - 32)], data=F32_16),
        "tensor offset unaligned": craft_gguf(infos=[tensor_info("w", [4], 0, 4)], data=F32_16),
        "tensor data truncated": craft_gguf(infos=[tensor_info("w", [64])], data=F32_16),
        "tensor with 5000 dims": craft_gguf(infos=[_s("w") + struct.pack("<I", 5000) + struct.pack("<Q", 1) * 8]),
        "tensor type 999": craft_gguf(infos=[tensor_info("w", [16], 999)], data=F32_16),
        "q4_0 row not a block multiple": craft_gguf(infos=[tensor_info("w", [17], 2)], data=F32_16),
        "duplicate tensor name": craft_gguf(infos=[tensor_info("w", [4]), tensor_info("w", [4], 0, 32)], data=F32_16 * 2),
        "invalid UTF-8 tensor name": craft_gguf(infos=[tensor_info(b"\xff\xfe", [4])], data=F32_16),
    }


def gguf_case_ids() -> list[str]:
    return list(_gguf_cases(b"GGUF" + b"\0" * 200).keys())


@pytest.mark.parametrize("case", gguf_case_ids())
def test_corrupt_gguf_reader(small_gguf, tmp_path, case):
    """GgufFile (used by inspect, eval, quantize, the torch reference): BadInputError, quickly."""
    p = tmp_path / "bad.gguf"
    p.write_bytes(_gguf_cases(small_gguf)[case])
    with pytest.raises(BadInputError) as ei:
        read_everything(p)
    assert "\n" not in str(ei.value) and len(str(ei.value)) < 400


INSPECT_CASES = ["zero-length", "wrong magic", "truncated in KV section", "truncated in tensor data",
                 "bit flip high in tensor count", "uint8 array of 2^32 items at EOF", "string array of 2^40 items",
                 "invalid UTF-8 architecture", "tensor claims 2^40 x 2^20 elements", "tensor offset past end",
                 "tensor type 999", "missing general.architecture"]


@pytest.mark.parametrize("case", INSPECT_CASES)
def test_corrupt_gguf_inspect_cli(small_gguf, tmp_path, case):
    p = tmp_path / "bad.gguf"
    p.write_bytes(_gguf_cases(small_gguf)[case])
    for extra in ([], ["--json"]):
        r = run_dsa("inspect", str(p), *extra, timeout=60)
        assert_one_line_error(r)
        assert r.stdout.strip() == ""


def test_inspect_not_a_file(tmp_path):
    assert_one_line_error(run_dsa("inspect", str(tmp_path / "nope.gguf")), needle="not found")
    assert_one_line_error(run_dsa("inspect", str(tmp_path)), needle="not found")


def _gguf_commands(p: Path, out: Path) -> list[list[str]]:
    """Every other command that reads a GGUF."""
    return [["eval", str(p), "--ctx", "64", "--chunks", "1"], ["quantize", str(p), str(out)]]


@pytest.mark.parametrize("case", ["zero-length", "wrong magic", "truncated in tensor data",
                                  "uint8 array of 2^32 items at EOF", "tensor offset past end"])
def test_corrupt_gguf_other_commands(small_gguf, tmp_path, case):
    p = tmp_path / "bad.gguf"
    p.write_bytes(_gguf_cases(small_gguf)[case])
    out = tmp_path / "out.gguf"
    for c in _gguf_commands(p, out):
        r = run_dsa(*c, timeout=90)
        assert_one_line_error(r)
        assert_no_output(out)


# ---------------------------------------------------------------- property-based: the GGUF read path
def _mutate(good: bytes, data) -> bytes:
    b = bytearray(good)
    kind = data.draw(st.sampled_from(["flip", "byte", "truncate", "u64", "u32", "splice", "extend"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "byte":
        b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
    elif kind == "truncate":
        b = b[: data.draw(st.integers(0, len(b) - 1))]
    elif kind in ("u64", "u32"):
        n = 8 if kind == "u64" else 4
        i = data.draw(st.integers(0, len(b) - n))
        v = data.draw(st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1]) if n == 8
                      else st.sampled_from([0, 1, 5, 9, 13, 2**31, 2**32 - 1]))
        b[i:i + n] = (v % 2**(8 * n)).to_bytes(n, "little")
    elif kind == "splice":
        i, j = sorted((data.draw(st.integers(0, len(b))), data.draw(st.integers(0, len(b)))))
        b = b[:i] + b[j:]
    else:
        b += data.draw(st.binary(min_size=1, max_size=64))
    return bytes(b)


@settings(max_examples=200, deadline=2000, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_gguf_reader_property(small_gguf, tmp_path, data):
    """Any mutation of a valid GGUF: GgufFile reads it or raises BadInputError — nothing else, no hang
    (2 s deadline per example), no runaway memory (address space capped at +2 GiB while reading)."""
    p = tmp_path / "m.gguf"
    p.write_bytes(_mutate(small_gguf, data))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cur = _vm_size()
    if cur:
        resource.setrlimit(resource.RLIMIT_AS, (cur + 2 * 2**30, hard))
    try:
        read_everything(p)
    except BadInputError as e:
        assert "\n" not in str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _vm_size() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def test_gguf_random_mutation_sweep(small_gguf, tmp_path):
    """A cheaper, wider sweep than the hypothesis test: 1500 seeded mutations of every kind."""
    rng = random.Random(1234)
    p = tmp_path / "m.gguf"
    outcomes = {"ok": 0, "rejected": 0}
    for _ in range(1500):
        b = bytearray(small_gguf)
        kind = rng.choice(["flip", "byte", "truncate", "u64"])
        if kind == "flip":
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
        elif kind == "byte":
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif kind == "truncate":
            b = b[: rng.randrange(len(b))]
        else:
            i = rng.randrange(len(b) - 8)
            b[i:i + 8] = rng.choice([2**63, 2**64 - 1, 2**32, 2**31 - 1]).to_bytes(8, "little")
        p.write_bytes(bytes(b))
        try:
            read_everything(p)
            outcomes["ok"] += 1
        except BadInputError:
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 500, outcomes


# ---------------------------------------------------------------- safetensors into `dsa convert`
@pytest.fixture(scope="module")
def good_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("good") / "m", "llama-linear-bias-headdim")   # one shard


@pytest.fixture
def model(good_model, tmp_path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(good_model, d)
    return d


def craft_st(header, data: bytes = b"", raw_len: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if raw_len is None else raw_len) + h + data


def _st_cases(good: bytes) -> dict[str, bytes]:
    n = struct.unpack("<Q", good[:8])[0]
    hdr = json.loads(good[8:8 + n])
    first = next(k for k in hdr if k != "__metadata__")
    data = good[8 + n:]

    def edit(**kw):
        h = json.loads(json.dumps(hdr))
        h[first].update(kw)
        return craft_st(h, data)

    begin, end = hdr[first]["data_offsets"]
    flip = bytearray(good)
    flip[9] ^= 0x40                    # inside the header length / JSON
    return {
        "zero-length shard": b"",
        "7-byte shard": b"\x01" * 7,
        "wrong magic (a GGUF renamed)": b"GGUF" + b"\0" * 60,
        "truncated data": good[: len(good) - max(1, len(data) // 2)],
        "truncated header": good[: 8 + n // 2],
        "header length 2^63": craft_st(b"{}", raw_len=2**63),
        "header length 0": craft_st(b"", raw_len=0),
        "header not JSON": craft_st(b"\xff\xfe not json"),
        "header JSON list": craft_st([1, 2, 3]),
        "header nested 100k deep": craft_st(b"[" * 100000 + b"]" * 100000),
        "bit flip in header": bytes(flip),
        "huge shape 2^40 x 2^40": edit(shape=[2**40, 2**40], data_offsets=[begin, begin + 2**80 * 4]),
        "shape product wraps int64": edit(shape=[2**62, 4]),
        "negative dims": edit(shape=[-1, -(end - begin) // 4]),
        "offsets past end": edit(data_offsets=[2**62, 2**62 + end - begin]),
        "negative offset": edit(data_offsets=[begin - 2**20, end - 2**20]),
        "float offsets": edit(data_offsets=[float(begin), float(end)]),
        "begin > end": edit(data_offsets=[end, begin]),
        "overlapping tensors": edit(data_offsets=[begin + 4, end + 4]),
        "unknown dtype": edit(dtype="F128"),
        "bool in shape": edit(shape=[True] + hdr[first]["shape"][1:]),
        "trailing garbage after data": good + b"\0" * 64,
        "__metadata__ not strings": craft_st({**hdr, "__metadata__": {"format": 1}}, data),
    }


ST_CASES = list(_st_cases(craft_st({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}},
                                   b"\0" * 16)).keys())


@pytest.mark.parametrize("case", ST_CASES)
def test_corrupt_safetensors_convert(model, tmp_path, case):
    shard = model / "model.safetensors"
    shard.write_bytes(_st_cases(shard.read_bytes())[case])
    out = tmp_path / "o.gguf"
    r = run_dsa("convert", str(model), str(out))
    assert_one_line_error(r)
    assert_no_output(out)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_nonfinite_weights(model, tmp_path, value):
    from safetensors.torch import load_file, save_file

    shard = model / "model.safetensors"
    t = load_file(shard)
    k = next(k for k in t if "mlp" in k)
    t[k].view(-1)[7] = float(value)
    save_file(t, shard, metadata={"format": "pt"})
    out = tmp_path / "o.gguf"
    r = run_dsa("convert", str(model), str(out))
    assert_one_line_error(r, needle="NaN or Inf")
    assert k in r.stderr
    assert_no_output(out)


def _make_index(model: Path, target: str) -> None:
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    wm = {n: "model.safetensors" for n in names}
    wm[names[0]] = target
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors",
                                    "link.safetensors"])
def test_index_points_outside(model, tmp_path, target):
    shutil.copy(model / "model.safetensors", tmp_path / "outside.safetensors")
    if target == "link.safetensors":
        (model / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    _make_index(model, target)
    out = tmp_path / "o.gguf"
    r = run_dsa("convert", str(model), str(out))
    assert_one_line_error(r, needle="outside the model directory")
    assert_no_output(out)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"weight_map": 5}', '{"weight_map": {"a": 7}}', ""])
def test_corrupt_index(model, tmp_path, text):
    (model / "model.safetensors.index.json").write_text(text)
    out = tmp_path / "o.gguf"
    r = run_dsa("convert", str(model), str(out))
    assert_one_line_error(r)
    assert_no_output(out)


# ---------------------------------------------------------------- output side
def _mount_tmpfs(d: Path, opts: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    d.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True)
    return r.returncode == 0


def _umount(d: Path) -> None:
    subprocess.run(["umount", str(d)], capture_output=True)


def test_unwritable_output_dir(model, tmp_path):
    ro = tmp_path / "ro"
    if os.geteuid() == 0:
        if not _mount_tmpfs(ro, "ro,size=64k"):
            pytest.skip("cannot mount a read-only tmpfs (no mount privilege in this container)")
    else:
        ro.mkdir()
        ro.chmod(0o500)
    try:
        out = ro / "o.gguf"
        r = run_dsa("convert", str(model), str(out))
        assert_one_line_error(r, needle="writ")
        assert_no_output(out)
    finally:
        if os.geteuid() == 0:
            _umount(ro)


def test_output_is_a_directory(model, tmp_path):
    out = tmp_path / "dir.gguf"
    out.mkdir()
    assert_one_line_error(run_dsa("convert", str(model), str(out)), needle="directory")
    assert out.is_dir() and not any(out.iterdir())


def test_disk_full_tmpfs(model, tmp_path):
    """A real ENOSPC: OUT on a 64 KiB tmpfs (the GGUF is ~300 KiB)."""
    d = tmp_path / "small"
    if not _mount_tmpfs(d, "size=64k"):
        pytest.skip("cannot mount a tmpfs (needs root and mount privilege)")
    try:
        out = d / "o.gguf"
        r = run_dsa("convert", str(model), str(out))
        # numpy's tofile() reports a short write without errno ("N requested and M written"), so the
        # message is atomic.py's generic "cannot write OUT: …" rather than "no space left on device"
        assert_one_line_error(r, needle="cannot write" if "requested and" in r.stderr else "no space left")
        assert_no_output(out)
        assert not any(d.iterdir()), list(d.iterdir())
    finally:
        _umount(d)


def test_file_size_limit(model, tmp_path):
    """A write failure in a real process without privileges: RLIMIT_FSIZE 64 KiB → EFBIG mid-write."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    out = tmp_path / "o.gguf"
    r = run_dsa("convert", str(model), str(out), preexec_fn=limit)
    assert_one_line_error(r, needle="cannot write")
    assert_no_output(out)


def test_disk_full_simulated(model, tmp_path, monkeypatch):
    """ENOSPC raised from inside the tensor writer after a few tensors (Python-level simulation)."""
    from dsa_convert.convert import ConvertOptions, convert
    from dsa_convert.formats import gguf_write

    real = gguf_write.encode
    calls = {"n": 0}

    def failing_encode(data, qtype):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(data, qtype)

    monkeypatch.setattr(gguf_write, "encode", failing_encode)
    out = tmp_path / "o.gguf"
    out_prev = tmp_path / "prev.gguf"
    with pytest.raises(BadInputError, match="no space left"):
        convert(ConvertOptions(model, out, quiet=True))
    assert_no_output(out)
    # with --force over an existing file, the old file survives a failed write untouched
    out_prev.write_bytes(b"previous good file")
    calls["n"] = 0
    with pytest.raises(BadInputError, match="no space left"):
        convert(ConvertOptions(model, out_prev, force=True, quiet=True))
    assert out_prev.read_bytes() == b"previous good file"
    assert not list(tmp_path.glob(".prev.gguf.partial-*"))


def test_missing_and_empty_model_dir(tmp_path):
    out = tmp_path / "o.gguf"
    assert_one_line_error(run_dsa("convert", str(tmp_path / "nope"), str(out)))
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run_dsa("convert", str(tmp_path / "empty"), str(out)))
    assert_no_output(out)


def test_config_not_json(model, tmp_path):
    (model / "config.json").write_bytes(b"\x00\xff{")
    out = tmp_path / "o.gguf"
    assert_one_line_error(run_dsa("convert", str(model), str(out)))
    assert_no_output(out)
