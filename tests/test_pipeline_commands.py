"""dsa_convert/pipeline/commands.py lists exactly the options of `dsa convert`, `dsa quantize` and `dsa eval`.

The pipeline reads flags from that table instead of importing the CLI (which imports the pipeline); this compares
the table with the Typer app, so an option added to (or renamed in) dsa_convert/cli.py without its line in the
table fails here rather than in a user's pipeline.
"""
from __future__ import annotations

import pytest
import typer

from dsa_convert.cli import app
from dsa_convert.pipeline.commands import COMMANDS, PATH, SWITCH, VALUE, Option
from dsa_convert.pipeline.spec import KINDS

RUNNER_FLAGS = {"--json", "--force"}     # set by the runner itself, not by a step's options


def _is_path(p) -> bool:
    ann = getattr(getattr(p, "type_descriptor", None), "annotation", None)
    return ann is not None and "Path" in repr(ann)


def cli_options(kind: str) -> dict[str, Option]:
    """The options of the installed `dsa KIND`, in the table's form."""
    cmd = typer.main.get_command(app).commands[kind]
    out = {}
    for p in cmd.params:
        if p.param_type_name != "option":
            continue
        flag = next(o for o in p.opts if o.startswith("--"))
        if flag in RUNNER_FLAGS:
            continue
        kind_ = SWITCH if p.is_flag else PATH if _is_path(p) else VALUE
        out[flag[2:].replace("-", "_")] = Option(flag, kind_, p.secondary_opts[0] if p.secondary_opts else None)
    return out


def test_table_covers_every_step_kind():
    assert set(COMMANDS) == set(KINDS)


@pytest.mark.parametrize("kind", sorted(COMMANDS))
def test_table_matches_cli(kind):
    table, cli = COMMANDS[kind].options, cli_options(kind)
    missing = {k: o for k, o in cli.items() if k not in table}
    assert not missing, f"add to COMMANDS[{kind!r}] in dsa_convert/pipeline/commands.py: {list(missing.values())}"
    extra = sorted(set(table) - set(cli))
    assert not extra, f"`dsa {kind}` has no options {extra}: remove them from COMMANDS[{kind!r}]"
    wrong = {k: (table[k], cli[k]) for k in cli if table[k] != cli[k]}
    assert not wrong, f"COMMANDS[{kind!r}] differs from the CLI (table, CLI): {wrong}"


@pytest.mark.parametrize("kind", sorted(COMMANDS))
def test_positional_arguments(kind):
    cmd = typer.main.get_command(app).commands[kind]
    n_args = sum(1 for p in cmd.params if p.param_type_name == "argument")
    assert n_args == len(COMMANDS[kind].arguments)
