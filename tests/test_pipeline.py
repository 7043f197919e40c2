"""`dsa pipeline run`: runs, skips unchanged steps, re-runs changed ones and their downstream, reports failures.

The skip/re-run tests use the real `dsa convert` and a stand-in for `dsa quantize` / `dsa eval` (written
by the test), so they check the pipeline machinery independently of the quantize/eval implementations;
`test_real_quantize_eval` runs the real commands when this installation has them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REF_MODEL, make_tiny_model, needs

from dsa_convert.errors import BadInputError
from dsa_convert.pipeline import run
from dsa_convert.pipeline.runner import RunOptions
from dsa_convert.pipeline.spec import parse

STUB = '''
import json, shutil, sys, time
args = sys.argv[1:]
if args[0] == "convert":
    from dsa_convert.cli import main
    sys.argv = ["dsa", *args]
    main()
def opt(name, default=None):
    return args[args.index(name) + 1] if name in args else default
if "--fail" in args:
    print("error: stub failure requested", file=sys.stderr); sys.exit(3)
if opt("--sleep"):
    time.sleep(float(opt("--sleep")))
if args[0] == "quantize":
    src, dst = args[1], args[2]
    with open(dst, "wb") as f:
        f.write(open(src, "rb").read() + opt("--type", "q4_0").encode())
    print(json.dumps({"output": dst, "type": opt("--type")}))
elif args[0] == "eval":
    print(json.dumps({"file": args[1], "results": [{"dataset": "stub", "ppl": 10.0 + int(opt("--ctx", 0)) / 100}]}))
'''


def write_toml(path: Path, model: Path, outtype="f32", qtype="q4_0", ctx=128, extra_model: Path | None = None,
               eval_opts: str = "") -> Path:
    body = f'''
    [pipeline]
    name = "t"
    workdir = "work"

    [[model]]
    name = "tiny"
    path = "{model}"
      [[model.step]]
      kind = "convert"
      name = "base"
      options = {{ outtype = "{outtype}", no_dsa = true }}
      [[model.step]]
      kind = "quantize"
      name = "q"
      options = {{ type = "{qtype}" }}
      [[model.step]]
      kind = "eval"
      name = "ppl"
      options = {{ ctx = {ctx}{eval_opts} }}
    '''
    if extra_model is not None:
        body += f'''
    [[model]]
    name = "second"
    path = "{extra_model}"
      [[model.step]]
      kind = "convert"
      options = {{ outtype = "f16" }}
    '''
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("pipe") / "tiny", "llama-llama3rope-tied-sharded")


@pytest.fixture
def stub_ro(tmp_path) -> RunOptions:
    stub = tmp_path / "stub_cli.py"
    stub.write_text(STUB)
    return RunOptions(cli=[sys.executable, str(stub)], introspect=False)


def statuses(summary: dict) -> dict[str, str]:
    return {f"{s['model']}/{s['step']}": s["status"] for s in summary["steps"]}


def test_run_skip_rerun_downstream(tiny, tmp_path, stub_ro):
    toml = write_toml(tmp_path / "p.toml", tiny)
    s1 = run(toml, ro=stub_ro, quiet=True)
    assert statuses(s1) == {"tiny/base": "ok", "tiny/q": "ok", "tiny/ppl": "ok"}, s1
    assert s1["ok"] and s1["exit_code"] == 0
    by = {s["step"]: s for s in s1["steps"]}
    assert by["ppl"]["ppl"] == pytest.approx(11.28)
    assert by["base"]["bytes"] > 0 and by["base"]["peak_rss_mib"] > 10
    work = tmp_path / "work"
    assert (work / "tiny" / "base.gguf.dsa-step.json").is_file()
    assert (work / "summary.json").is_file() and "| tiny | ppl | eval | ok |" in (work / "summary.md").read_text()

    # second run: nothing to do
    s2 = run(toml, ro=stub_ro, quiet=True)
    assert set(statuses(s2).values()) == {"skipped"}, s2
    assert {s["step"]: s["ppl"] for s in s2["steps"]}["ppl"] == pytest.approx(11.28)   # PPL carried over

    # change the quantize option: convert skipped, quantize and eval re-run
    write_toml(toml, tiny, qtype="q8_0")
    s3 = run(toml, ro=stub_ro, quiet=True)
    assert statuses(s3) == {"tiny/base": "skipped", "tiny/q": "ok", "tiny/ppl": "ok"}, s3
    assert {s["step"]: s["reason"] for s in s3["steps"]}["ppl"] in ("inputs or options changed", "upstream step re-ran")

    # change only the eval option: only eval re-runs
    write_toml(toml, tiny, qtype="q8_0", ctx=256)
    s4 = run(toml, ro=stub_ro, quiet=True)
    assert statuses(s4) == {"tiny/base": "skipped", "tiny/q": "skipped", "tiny/ppl": "ok"}, s4
    assert {s["step"]: s["ppl"] for s in s4["steps"]}["ppl"] == pytest.approx(12.56)

    # change the convert option: everything re-runs
    write_toml(toml, tiny, outtype="f16", qtype="q8_0", ctx=256)
    s5 = run(toml, ro=stub_ro, quiet=True)
    assert set(statuses(s5).values()) == {"ok"}, s5


def test_input_change_and_output_tamper_rerun(tiny, tmp_path, stub_ro):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    toml = write_toml(tmp_path / "p.toml", model)
    assert set(statuses(run(toml, ro=stub_ro, quiet=True)).values()) == {"ok"}
    # an output edited by hand: that step and downstream re-run
    q = tmp_path / "work" / "tiny" / "q.gguf"
    q.write_bytes(q.read_bytes() + b"x")
    assert statuses(run(toml, ro=stub_ro, quiet=True)) == {"tiny/base": "skipped", "tiny/q": "ok", "tiny/ppl": "ok"}
    # the checkpoint's content changes (config edit): everything re-runs
    cfg = json.loads((model / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (model / "config.json").write_text(json.dumps(cfg))
    assert set(statuses(run(toml, ro=stub_ro, quiet=True)).values()) == {"ok"}
    # a deleted output is rebuilt
    (tmp_path / "work" / "tiny" / "base.gguf").unlink()
    assert set(statuses(run(toml, ro=stub_ro, quiet=True)).values()) == {"ok"}


def test_eval_dataset_change_reruns_eval(tiny, tmp_path, stub_ro, monkeypatch):
    """`ppl = "wikitext2"` resolves through $DSA_WIKITEXT2 etc.; the resolved file is part of the step's hash."""
    text = tmp_path / "wiki.test.raw"
    text.write_text("some text\n" * 100)
    monkeypatch.setenv("DSA_WIKITEXT2", str(text))
    toml = write_toml(tmp_path / "p.toml", tiny, eval_opts=', ppl = "wikitext2"')
    assert set(statuses(run(toml, ro=stub_ro, quiet=True)).values()) == {"ok"}
    assert set(statuses(run(toml, ro=stub_ro, quiet=True)).values()) == {"skipped"}
    text.write_text("other text\n" * 100)
    assert statuses(run(toml, ro=stub_ro, quiet=True)) == {"tiny/base": "skipped", "tiny/q": "skipped", "tiny/ppl": "ok"}


def test_failing_step_stops_model_and_pipeline(tiny, tmp_path, stub_ro):
    toml = write_toml(tmp_path / "p.toml", tiny, eval_opts=", fail = true", extra_model=tiny)
    s = run(toml, ro=stub_ro, quiet=True)
    assert statuses(s) == {"tiny/base": "ok", "tiny/q": "ok", "tiny/ppl": "failed", "second/convert": "not-run"}
    assert not s["ok"] and s["exit_code"] == 1
    failed = next(x for x in s["steps"] if x["status"] == "failed")
    assert failed["error"] == "error: stub failure requested" and failed["exit_code"] == 3
    md = (tmp_path / "work" / "summary.md").read_text()
    assert "| tiny | ppl | eval | failed |" in md
    # --keep-going: the other model still runs; the failed step is retried (no success recorded)
    s = run(toml, ro=stub_ro, quiet=True, keep_going=True)
    assert statuses(s) == {"tiny/base": "skipped", "tiny/q": "skipped", "tiny/ppl": "failed", "second/convert": "ok"}
    assert s["exit_code"] == 1


def test_step_timeout(tiny, tmp_path, stub_ro):
    toml = write_toml(tmp_path / "p.toml", tiny, eval_opts=", sleep = 60")
    text = toml.read_text().replace('name = "ppl"', 'name = "ppl"\n  timeout = 1')
    toml.write_text(text)
    s = run(toml, ro=stub_ro, quiet=True)
    ppl = next(x for x in s["steps"] if x["step"] == "ppl")
    assert ppl["status"] == "failed" and "timed out" in ppl["error"] and ppl["seconds"] < 30


# ---------------------------------------------------------------- through the real CLI
def dsa(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsa_convert.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def convert_only_toml(path: Path, models: dict[str, Path]) -> Path:
    body = '[pipeline]\nworkdir = "w"\n'
    for name, p in models.items():
        body += (f'\n[[model]]\nname = "{name}"\npath = "{p}"\n  [[model.step]]\n  kind = "convert"\n'
                 f'  options = {{ outtype = "f16", no_dsa = true }}\n')
    path.write_text(body)
    return path


def test_cli_failure_exit_code_and_summary(tiny, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    toml = convert_only_toml(tmp_path / "p.toml", {"bad": broken, "good": tiny})
    r = dsa("pipeline", "run", str(toml), "--json")
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: pipeline failed at bad/convert")
    s = json.loads(r.stdout)
    assert statuses(s) == {"bad/convert": "failed", "good/convert": "not-run"}
    assert s["steps"][0]["exit_code"] == 3 and s["steps"][0]["error"].startswith("error:")
    r = dsa("pipeline", "run", str(toml), "--json", "--keep-going", "--workdir", str(tmp_path / "w2"))
    assert r.returncode == 1
    s = json.loads(r.stdout)
    assert statuses(s) == {"bad/convert": "failed", "good/convert": "ok"}
    assert json.loads((tmp_path / "w2" / "summary.json").read_text())["counts"]["failed"] == 1
    assert "| bad | convert | convert | failed |" in (tmp_path / "w2" / "summary.md").read_text()
    # fix the model: the good one is skipped, the bad one now runs; exit 0
    toml = convert_only_toml(toml, {"bad": tiny, "good": tiny})
    r = dsa("pipeline", "run", str(toml), "--workdir", str(tmp_path / "w2"))
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "w2" / "summary.json").read_text())
    assert statuses(s) == {"bad/convert": "ok", "good/convert": "skipped"}


BAD_SPECS = [
    ("[[model]\n", "invalid TOML"),
    ("[pipeline]\nname='x'\n", "no [[model]] entries"),
    ("[pipelin]\n", "unknown key 'pipelin'"),
    ('[[model]]\npath="m"\n[[model.step]]\nkind="compile"\n', "unknown step kind 'compile'"),
    ('[[model]]\npath="m"\n[[model.step]]\nkind="eval"\n', "needs an earlier convert or quantize step"),
    ('[[model]]\npath="m"\n[[model.step]]\nkind="convert"\n[[model.step]]\nkind="convert"\n', "duplicate step name"),
    ('[[model]]\npath="m"\n[[model.step]]\nkind="convert"\n[[model.step]]\nkind="quantize"\ninput="nope"\n',
     "input 'nope' is not an earlier"),
    ('[[model]]\npath="${DSA_TEST_SURELY_UNSET}/m"\n[[model.step]]\nkind="convert"\n', "DSA_TEST_SURELY_UNSET is not set"),
    ('[[model]]\npath="m"\n[[model.step]]\nkind="convert"\noptions={force=true}\n', "set by the pipeline itself"),
    ('[[model]]\npath="m"\n[[model.step]]\nkind="convert"\noptions={outtype={a=1}}\n', "must be a string"),
    ('[[model]]\npath="m"\n[[model.step]]\nkind="convert"\ntimeout=-1\n', "timeout must be a positive"),
    ('[[model]]\npath="m"\nname="a b"\n[[model.step]]\nkind="convert"\n', "may only use letters"),
]


@pytest.mark.parametrize("text,needle", BAD_SPECS, ids=[n for _, n in BAD_SPECS])
def test_bad_spec_rejected(tmp_path, text, needle):
    p = tmp_path / "p.toml"
    p.write_text(text)
    with pytest.raises(BadInputError, match=None) as ei:
        parse(p)
    assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_cli_bad_spec_and_unknown_option(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text('[[model]]\npath="m"\n[[model.step]]\nkind="convert"\noptions={outtipe="f16"}\n')
    r = dsa("pipeline", "run", str(p))
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        r.stderr.strip().splitlines()[-1]] and "has no option 'outtipe'" in r.stderr
    r = dsa("pipeline", "run", str(tmp_path / "missing.toml"))
    assert r.returncode == 3 and "pipeline file not found" in r.stderr


def test_env_expansion_and_relative_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("DSA_TEST_MODELS", str(tmp_path / "models"))
    p = tmp_path / "sub" / "p.toml"
    p.parent.mkdir()
    p.write_text('[pipeline]\nworkdir="${DSA_TEST_NOPE:-out}"\n[[model]]\npath="${DSA_TEST_MODELS}/a"\n'
                 '[[model.step]]\nkind="convert"\n')
    s = parse(p)
    assert s.workdir == (tmp_path / "sub" / "out").resolve()
    assert s.models[0].path == (tmp_path / "models" / "a").resolve() and s.models[0].name == "a"
    assert parse(p, workdir=tmp_path / "w").workdir == (tmp_path / "w").resolve()


def test_example_pipeline_parses():
    root = Path(__file__).resolve().parents[1]
    s = parse(root / "examples" / "pipeline.toml")
    assert [st.kind for st in s.models[0].steps] == ["convert", "quantize", "eval"]
    assert s.models[0].path.name == "ref-llama-27m"


@pytest.mark.slow
@pytest.mark.backend
@needs(REF_MODEL)          # examples/pipeline.toml names ../shared/models/ref-llama-27m
def test_real_quantize_eval(tmp_path):
    """The example pipeline end to end with the real commands, then a second run skips every step."""
    root = Path(__file__).resolve().parents[1]
    r = dsa("pipeline", "run", str(root / "examples" / "pipeline.toml"), "--json", "--workdir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert set(statuses(s).values()) == {"ok"}
    assert 1 < s["steps"][-1]["ppl"] < 10000
    r = dsa("pipeline", "run", str(root / "examples" / "pipeline.toml"), "--json", "--workdir", str(tmp_path))
    assert r.returncode == 0 and set(statuses(json.loads(r.stdout)).values()) == {"skipped"}
