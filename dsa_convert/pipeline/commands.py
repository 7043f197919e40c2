"""The `dsa` commands a pipeline step runs (convert, quantize, eval): their positional arguments and options.

The runner turns a step's TOML options into the command line of a child `python -m dsa_convert.cli KIND …`
process. It reads the flags from this table, not from the Typer app in dsa_convert/cli.py, because the CLI imports
the pipeline (`dsa pipeline run`) and the pipeline must not import the CLI back. tests/test_pipeline_commands.py
checks that the table lists exactly the options of the installed commands, so an option added to the CLI without
a line here fails there.

A TOML key is the long flag without its dashes, `-` spelled `_` (`--cluster-num` -> `cluster_num`). The flags the
runner sets itself (`--json`, `--force`) are not in the table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

VALUE, PATH, SWITCH = "value", "path", "switch"


@dataclass(frozen=True)
class Option:
    flag: str                     # the long flag, e.g. "--cluster-num"
    kind: str = VALUE             # VALUE; PATH: a file, resolved against the TOML file's folder and hashed;
                                  # SWITCH: a flag without a value (true adds it, false adds `off_flag` if any)
    off_flag: str | None = None   # a switch's negative form, e.g. "--no-flash-attn"

    @property
    def key(self) -> str:
        return self.flag[2:].replace("-", "_")


@dataclass(frozen=True)
class Command:
    name: str                             # `dsa NAME`
    arguments: tuple[str, ...]            # positional arguments in order, e.g. ("MODEL_DIR", "OUT")
    options: dict[str, Option] = field(default_factory=dict)   # by TOML key

    def option(self, key: str) -> Option | None:
        return self.options.get(key)


def _command(name: str, arguments: tuple[str, ...], *options: Option) -> Command:
    return Command(name, arguments, {o.key: o for o in options})


COMMANDS: dict[str, Command] = {
    "convert": _command(
        "convert", ("MODEL_DIR", "OUT"),
        Option("--outtype"), Option("--no-dsa", SWITCH), Option("--cluster-num"), Option("--top-k"),
        Option("--index-heads"), Option("--index-dim"), Option("--index-share"), Option("--index-place"),
        Option("--sink"), Option("--local"), Option("--select"), Option("--block-size"), Option("--residual-bits"),
        Option("--calib", PATH), Option("--calib-ctx"), Option("--calib-tokens"), Option("--steps"),
        Option("--query-rows"), Option("--split-search"), Option("--placement-search"), Option("--device"),
        Option("--seed"), Option("--allow-eval-calib", SWITCH), Option("--time-budget"), Option("--memory-budget")),
    "quantize": _command(
        "quantize", ("IN", "OUT"),
        Option("--method"), Option("--type"), Option("--group-size"), Option("--calib", PATH), Option("--samples"),
        Option("--seq-len"), Option("--device"), Option("--imatrix"), Option("--no-clip", SWITCH),
        Option("--threads"), Option("--seed"), Option("--damp"), Option("--no-sequential", SWITCH),
        Option("--act-order", SWITCH), Option("--gptq-types"), Option("--size-budget")),
    "eval": _command(
        "eval", ("FILE",),
        Option("--ppl"), Option("--needle"), Option("--backend"), Option("--attn"), Option("--kv"),
        Option("--index-keys"), Option("--ctx"), Option("--chunks"), Option("--top-k"), Option("--data", PATH),
        Option("--download", SWITCH), Option("--n-gpu-layers"), Option("--threads"),
        Option("--flash-attn", SWITCH, "--no-flash-attn"),
        Option("--tokenizer", PATH), Option("--device"), Option("--seed"), Option("--kld", SWITCH),
        Option("--kld-base", PATH), Option("--lengths"),
        Option("--depths"), Option("--trials"), Option("--filler"), Option("--max-new"), Option("--plot", PATH)),
}


def command(kind: str) -> Command:
    """The table entry of `dsa KIND` (a step kind the spec accepted: convert, quantize or eval)."""
    return COMMANDS[kind]
