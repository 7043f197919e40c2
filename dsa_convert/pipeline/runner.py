"""Execute a pipeline: every step is a child `python -m dsa_convert.cli KIND … --json` process.

Why a child per step (even for convert, whose Python entry point is in-process callable): the peak
RSS of each step is measured exactly (os.wait4's rusage of that child), a crash in native code
(llama.cpp, torch) fails one step instead of the whole pipeline, a step can be timed out, and
Ctrl-C reaches the step, which cleans its partial output (atomic writes) before the pipeline stops.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import BadInputError
from . import state as st
from .commands import PATH, Command, command
from .spec import ModelSpec, PipelineSpec, StepSpec, resolve_path

OK, SKIPPED, FAILED, NOT_RUN = "ok", "skipped", "failed", "not-run"
DEFAULT_CLI = [sys.executable, "-m", "dsa_convert.cli"]


@dataclass
class StepResult:
    model: str
    step: str
    kind: str
    status: str
    reason: str = ""
    seconds: float | None = None
    peak_rss_mib: float | None = None
    ppl: float | None = None
    output: str | None = None
    bytes: int | None = None
    exit_code: int | None = None
    error: str | None = None
    log: str | None = None
    command: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# ---------------------------------------------------------------- command lines
def check_options(spec: PipelineSpec) -> None:
    """Reject option names that `dsa KIND` does not have (one line, exit 3)."""
    for m in spec.models:
        for s in m.steps:
            cmd = command(s.kind)
            for key in s.options:
                if cmd.option(key) is None:
                    known = ", ".join(sorted(cmd.options))
                    raise BadInputError(f"{spec.file.name}: model {m.name!r} step {s.name!r}: `dsa {s.kind}` has no "
                                        f"option {key!r} (known: {known})")


def option_argv(step: StepSpec, base: Path, cmd: Command | None) -> tuple[list[str], list[Path]]:
    """TOML options -> CLI flags; returns (argv, input paths named by options). Without a command table entry
    (`cmd` None: a stand-in CLI) a key becomes `--key-with-dashes` and a value with a `/` a path."""
    argv: list[str] = []
    paths: list[Path] = []
    for key, val in sorted(step.options.items()):
        opt = cmd.option(key) if cmd is not None else None
        flag = opt.flag if opt is not None else "--" + key.replace("_", "-")
        values = val if isinstance(val, list) else [val]
        for v in values:
            if isinstance(v, bool):
                if v:
                    argv.append(flag)
                elif opt is not None and opt.off_flag:
                    argv.append(opt.off_flag)
                continue
            s = str(v)
            is_path = opt is not None and opt.kind == PATH
            cand = resolve_path(s, base) if isinstance(v, str) else None
            if is_path or (cand is not None and (cand.exists() or (opt is None and "/" in s))):
                s = str(cand)
                if cand.exists():
                    paths.append(cand)
            argv += [flag, s]
    return argv, paths


def eval_dataset(step: StepSpec, base: Path) -> Path | None:
    """The text file an eval step will score (`ppl` = a dataset name or a file, `data` = a file), resolved the
    way `dsa eval` resolves it, so that a changed dataset re-runs the step. None if it cannot be resolved
    here (the step itself then fails with the CLI's message)."""
    from ..errors import DsaError
    from ..eval import data as evdata

    ppl, data = str(step.options.get("ppl", "wikitext2")), step.options.get("data")
    as_file = resolve_path(ppl, base)
    try:
        return evdata.resolve(str(as_file) if as_file.is_file() else ppl,
                              resolve_path(str(data), base) if data else None, download=False)
    except (DsaError, OSError):
        return None


def step_output(workdir: Path, model: ModelSpec, step: StepSpec) -> Path:
    ext = ".gguf" if step.kind in ("convert", "quantize") else ".json"
    return workdir / model.name / f"{step.name}{ext}"


def step_argv(kind: str, input_path: Path, output: Path, opts: list[str]) -> list[str]:
    """Positional layout: convert MODEL OUT; quantize IN OUT; eval FILE (the runner writes eval's OUT from its
    JSON on stdout)."""
    if kind == "convert":
        return ["convert", str(input_path), str(output), *opts, "--force", "--json"]
    if kind == "quantize":
        return ["quantize", str(input_path), str(output), *opts, "--force", "--json"]
    return ["eval", str(input_path), *opts, "--json"]


# ---------------------------------------------------------------- child processes
def _find_number(obj: Any, keys: tuple[str, ...]) -> float | None:
    if isinstance(obj, dict):
        for k in keys:
            v = obj.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
        for v in obj.values():
            r = _find_number(v, keys)
            if r is not None:
                return r
    elif isinstance(obj, list):
        for v in obj:
            r = _find_number(v, keys)
            if r is not None:
                return r
    return None


def find_ppl(obj: Any) -> float | None:
    return _find_number(obj, ("ppl", "perplexity"))


def last_error_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errs = [ln for ln in lines if ln.startswith("error:")]
    return (errs[-1] if errs else (lines[-1] if lines else ""))[:400]


def run_child(argv: list[str], stdout: Path, stderr: Path, timeout: float | None) -> tuple[int, float, float]:
    """Run argv; returns (exit code, seconds, peak RSS MiB of that child). Ctrl-C is passed on."""
    import subprocess

    t0 = time.monotonic()
    with open(stdout, "wb") as fo, open(stderr, "wb") as fe:
        proc = subprocess.Popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL)
    try:
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if timeout is not None and time.monotonic() - t0 > timeout:
                proc.send_signal(signal.SIGINT)          # let it clean up, then insist
                try:
                    pid, status, ru = _wait4_timeout(proc.pid, 15)
                except TimeoutError:
                    proc.kill()
                    pid, status, ru = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)
                with open(stderr, "a") as fe:
                    fe.write(f"\nerror: step timed out after {timeout:g} s\n")
                return 124, time.monotonic() - t0, ru.ru_maxrss / 1024.0
            time.sleep(0.05)
    except KeyboardInterrupt:
        try:
            proc.send_signal(signal.SIGINT)
            _wait4_timeout(proc.pid, 30)
        except (TimeoutError, ChildProcessError, ProcessLookupError):
            try:
                proc.kill()
                os.wait4(proc.pid, 0)
            except (ChildProcessError, ProcessLookupError):
                pass
        proc.returncode = -2
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.monotonic() - t0, ru.ru_maxrss / 1024.0


def _wait4_timeout(pid: int, seconds: float):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        p, status, ru = os.wait4(pid, os.WNOHANG)
        if p:
            return p, status, ru
        time.sleep(0.05)
    raise TimeoutError


# ---------------------------------------------------------------- the run
@dataclass
class RunOptions:
    keep_going: bool = False
    cli: list[str] = field(default_factory=lambda: list(DEFAULT_CLI))
    introspect: bool = True           # map options through the command table (commands.py); off: a stand-in
                                      # CLI whose flags are the keys spelled --key-with-dashes
    on_step: Callable[[StepResult], None] | None = None
    on_start: Callable[[str, str, str], None] | None = None


def _atomic_write(p: Path, text: str) -> None:
    tmp = p.with_name(f".{p.name}.partial-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, p)


def run_step(spec: PipelineSpec, model: ModelSpec, step: StepSpec, outputs: dict[str, Path],
             dirty: set[str], hasher: st.Hasher, ro: RunOptions) -> StepResult:
    out = step_output(spec.workdir, model, step)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = StepResult(model.name, step.name, step.kind, FAILED, output=str(out))
    cmd = command(step.kind) if ro.introspect else None
    input_path = model.path if step.kind == "convert" else outputs[step.input]
    opts, opt_paths = option_argv(step, spec.base_dir, cmd)
    # for eval the runner writes OUT from the child's JSON stdout; the child writes GGUFs itself
    argv = step_argv(step.kind, input_path, out, opts)
    res.command = ["dsa", *argv]
    inputs = {"input": hasher.path(input_path)}
    for i, p in enumerate(opt_paths):
        inputs[f"option{i}:{p}"] = hasher.path(p)
    if step.kind == "eval" and (ds := eval_dataset(step, spec.base_dir)) is not None:
        inputs["dataset"] = hasher.path(ds)
    fp = st.fingerprint(step.kind, opts, inputs)
    fresh, why = st.is_fresh(out, fp)
    upstream_ran = step.input is not None and step.input in dirty
    if fresh and not upstream_ran:
        rec = st.load_state(out) or {}
        res.status, res.reason, res.seconds = SKIPPED, why, 0.0
        res.ppl = rec.get("ppl")
        res.bytes = out.stat().st_size if step.kind != "eval" else rec.get("bytes")
        return res
    res.reason = "upstream step re-ran" if fresh and upstream_ran else why
    res.seconds = 0.0
    dirty.add(step.name)
    log = out.with_name(f"{step.name}.log")
    stdout = out.with_name(f".{step.name}.stdout-{os.getpid()}")
    res.log = str(log)
    if not input_path.exists():
        res.error = f"input not found: {input_path}"
        log.write_text(f"error: {res.error}\n")
        return res
    try:
        code, secs, rss = run_child([*ro.cli, *argv], stdout, log, step.timeout)
        res.exit_code, res.seconds, res.peak_rss_mib = code, round(secs, 3), round(rss, 1)
        text = stdout.read_text(errors="replace")
    finally:
        stdout.unlink(missing_ok=True)
    payload: Any = None
    if code == 0:
        try:
            payload = json.loads(text) if text.strip() else {}
        except ValueError:
            code, res.exit_code = 1, 1
            res.error = f"`dsa {step.kind} --json` printed invalid JSON"
    if code != 0:
        if code < 0:  # killed by a signal: a native crash (SIGSEGV/SIGABRT) or the OOM killer (SIGKILL)
            try:
                sig = signal.Signals(-code).name
            except ValueError:
                sig = f"signal {-code}"
            res.error = res.error or f"`dsa {step.kind}` crashed ({sig})" + (
                f": {last_error_line(log)}" if last_error_line(log) else "")
        res.error = res.error or last_error_line(log) or f"exit code {code}"
        return res
    if step.kind == "eval":
        res.ppl = find_ppl(payload)
        if res.ppl is None:
            res.error = "eval output has no ppl/perplexity field"
            return res
        _atomic_write(out, json.dumps(payload, indent=2, default=str) + "\n")
        res.bytes = None
    else:
        if not out.is_file():
            res.error = f"`dsa {step.kind}` exited 0 but wrote no {out.name}"
            return res
        res.bytes = out.stat().st_size
    res.status = OK
    st.save_state(out, fp, {"kind": step.kind, "command": res.command, "inputs": inputs, "ppl": res.ppl,
                            "bytes": res.bytes, "seconds": res.seconds, "peak_rss_mib": res.peak_rss_mib,
                            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return res


def run_pipeline(spec: PipelineSpec, ro: RunOptions | None = None,
                 results: list[StepResult] | None = None) -> list[StepResult]:
    """Runs every model's steps in order; appends to `results` as it goes (kept on Ctrl-C)."""
    ro = ro or RunOptions()
    try:
        spec.workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInputError(f"cannot create workdir {spec.workdir}: {e.strerror or e}") from None
    hasher = st.Hasher(spec.hash_mode)
    results = [] if results is None else results
    stop = False
    for model in spec.models:
        outputs: dict[str, Path] = {}
        dirty: set[str] = set()
        failed_here = False
        for step in model.steps:
            if stop or failed_here:
                r = StepResult(model.name, step.name, step.kind, NOT_RUN,
                               reason="an earlier step of this model failed" if failed_here
                               else "stopped after a failure (no --keep-going)")
            else:
                if ro.on_start:
                    ro.on_start(model.name, step.name, step.kind)
                r = run_step(spec, model, step, outputs, dirty, hasher, ro)
                outputs[step.name] = step_output(spec.workdir, model, step)
                if r.status == FAILED:
                    failed_here = True
                    stop = not ro.keep_going
            results.append(r)
            if ro.on_step:
                ro.on_step(r)
    return results
