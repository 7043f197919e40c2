"""Pipeline TOML -> typed dataclasses, validated with one-line errors (BadInputError, exit 3).

    [pipeline]
    name = "ref"                      # optional, default: the file's stem
    workdir = "build/pipeline"        # optional, relative to the TOML file; `--workdir` overrides
    hash = "auto"                     # auto | full | quick  (see state.py)

    [[model]]
    name = "ref-llama-27m"            # [A-Za-z0-9._-]+, unique
    path = "${DSA_SHARED:-../shared}/models/ref-llama-27m"

      [[model.step]]
      kind = "convert"                # convert | quantize | eval
      name = "f16"                    # optional, default: kind; unique within the model
      input = "f16"                   # quantize/eval only: an earlier GGUF-producing step (default: the last one)
      timeout = 600                   # optional, seconds
      options = { outtype = "f16", no_dsa = true }   # `dsa KIND` options, `--long-name` spelled long_name

Strings (path, workdir, option values) expand `${VAR}` and `${VAR:-default}` from the environment.
Relative paths are taken relative to the TOML file's directory.
"""
from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from ..errors import BadInputError

KINDS = ("convert", "quantize", "eval")
PRODUCES_GGUF = ("convert", "quantize")
HASH_MODES = ("auto", "full", "quick")
# options the runner sets itself
RESERVED_OPTIONS = {"json", "as_json", "force", "out", "output", "quiet"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")

Scalar = Union[str, int, float, bool]
OptionValue = Union[Scalar, list]


@dataclass(frozen=True)
class StepSpec:
    kind: str
    name: str
    options: dict[str, OptionValue] = field(default_factory=dict)
    input: str | None = None          # name of the upstream step (quantize / eval)
    timeout: float | None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path
    steps: tuple[StepSpec, ...]


@dataclass(frozen=True)
class PipelineSpec:
    file: Path
    name: str
    workdir: Path
    hash_mode: str
    models: tuple[ModelSpec, ...]

    @property
    def base_dir(self) -> Path:
        return self.file.parent


def expand_vars(s: str, where: str) -> str:
    def sub(m: re.Match) -> str:
        var, default = m.group(1), m.group(2)
        val = os.environ.get(var)
        if val is None or (val == "" and default is not None):
            if default is None:
                raise BadInputError(f"{where}: environment variable {var} is not set (use ${{{var}:-default}})")
            return default
        return val
    return _VAR_RE.sub(sub, s)


def _expand(v: Any, where: str) -> Any:
    if isinstance(v, str):
        return expand_vars(v, where)
    if isinstance(v, list):
        return [_expand(x, where) for x in v]
    return v


def resolve_path(p: str, base: Path) -> Path:
    q = Path(p).expanduser()
    return (q if q.is_absolute() else base / q).resolve()


def _table(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise BadInputError(f"{where}: expected a table, got {type(v).__name__}")
    return v


def _unknown(d: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise BadInputError(f"{where}: unknown key {extra[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _str(d: dict, key: str, where: str, required: bool = False) -> str | None:
    v = d.get(key)
    if v is None:
        if required:
            raise BadInputError(f"{where}: missing required key {key!r}")
        return None
    if not isinstance(v, str) or not v:
        raise BadInputError(f"{where}: {key!r} must be a non-empty string")
    return expand_vars(v, where)


def _name(v: str, where: str) -> str:
    if not _NAME_RE.match(v):
        raise BadInputError(f"{where}: name {v!r} may only use letters, digits, '.', '_' and '-'")
    return v


def _options(v: Any, where: str) -> dict[str, OptionValue]:
    opts = _table(v if v is not None else {}, f"{where}.options")
    out: dict[str, OptionValue] = {}
    for k, val in opts.items():
        key = k.replace("-", "_")
        if not re.match(r"^[a-z][a-z0-9_]*$", key):
            raise BadInputError(f"{where}: bad option name {k!r}")
        if key in RESERVED_OPTIONS:
            raise BadInputError(f"{where}: option {k!r} is set by the pipeline itself")
        ok_scalar = (str, int, float, bool)
        if isinstance(val, list):
            if not all(isinstance(x, ok_scalar) for x in val):
                raise BadInputError(f"{where}: option {k!r} must be a list of strings/numbers/booleans")
        elif not isinstance(val, ok_scalar):
            raise BadInputError(f"{where}: option {k!r} must be a string, number, boolean or list")
        out[key] = _expand(val, f"{where}.options.{k}")
    return out


def _step(d: Any, where: str, earlier: dict[str, StepSpec]) -> StepSpec:
    d = _table(d, where)
    _unknown(d, {"kind", "name", "input", "options", "timeout"}, where)
    kind = _str(d, "kind", where, required=True)
    if kind not in KINDS:
        raise BadInputError(f"{where}: unknown step kind {kind!r} (choose from {', '.join(KINDS)})")
    name = _name(_str(d, "name", where) or kind, where)
    where = f"{where} ({name})"
    if name in earlier:
        raise BadInputError(f"{where}: duplicate step name {name!r} (give the steps distinct `name`s)")
    inp = _str(d, "input", where)
    if kind == "convert":
        if inp is not None:
            raise BadInputError(f"{where}: a convert step reads the model's `path`, it takes no `input`")
    else:
        producers = [s.name for s in earlier.values() if s.kind in PRODUCES_GGUF]
        if inp is None:
            if not producers:
                raise BadInputError(f"{where}: a {kind} step needs an earlier convert or quantize step")
            inp = producers[-1]
        elif inp not in producers:
            raise BadInputError(f"{where}: input {inp!r} is not an earlier convert/quantize step of this model")
    timeout = d.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise BadInputError(f"{where}: timeout must be a positive number of seconds")
    return StepSpec(kind, name, _options(d.get("options"), where), inp, float(timeout) if timeout else None)


def parse(file: Path, workdir: Path | None = None) -> PipelineSpec:
    file = Path(file)
    if not file.is_file():
        raise BadInputError(f"pipeline file not found: {file}")
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise BadInputError(f"{file.name}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInputError(f"{file.name}: invalid TOML: {str(e).splitlines()[0]}") from None
    return from_dict(raw, file, workdir)


def from_dict(raw: dict, file: Path, workdir: Path | None = None) -> PipelineSpec:
    file = Path(file).resolve()
    base = file.parent
    fname = file.name
    _unknown(raw, {"pipeline", "model"}, fname)
    top = _table(raw.get("pipeline", {}), f"{fname}: [pipeline]")
    _unknown(top, {"name", "workdir", "hash"}, f"{fname}: [pipeline]")
    name = _name(_str(top, "name", f"{fname}: [pipeline]") or file.stem, f"{fname}: [pipeline]")
    hash_mode = _str(top, "hash", f"{fname}: [pipeline]") or "auto"
    if hash_mode not in HASH_MODES:
        raise BadInputError(f"{fname}: [pipeline] hash must be one of {', '.join(HASH_MODES)}")
    if workdir is not None:
        wd = Path(workdir).resolve()
    else:
        wd = resolve_path(_str(top, "workdir", f"{fname}: [pipeline]") or f"pipeline-{name}", base)
    models_raw = raw.get("model")
    if not isinstance(models_raw, list) or not models_raw:
        raise BadInputError(f"{fname}: no [[model]] entries")
    models: list[ModelSpec] = []
    seen: set[str] = set()
    for i, m in enumerate(models_raw):
        where = f"{fname}: model #{i + 1}"
        m = _table(m, where)
        _unknown(m, {"name", "path", "step"}, where)
        path = resolve_path(_str(m, "path", where, required=True), base)
        mname = _name(_str(m, "name", where) or path.name, where)
        where = f"{fname}: model {mname!r}"
        if mname in seen:
            raise BadInputError(f"{where}: duplicate model name")
        seen.add(mname)
        steps_raw = m.get("step")
        if not isinstance(steps_raw, list) or not steps_raw:
            raise BadInputError(f"{where}: no [[model.step]] entries")
        steps: dict[str, StepSpec] = {}
        for j, s in enumerate(steps_raw):
            st = _step(s, f"{where} step #{j + 1}", steps)
            steps[st.name] = st
        models.append(ModelSpec(mname, path, tuple(steps.values())))
    return PipelineSpec(file, name, wd, hash_mode, tuple(models))
