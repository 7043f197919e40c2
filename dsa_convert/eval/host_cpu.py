"""Which host CPU a benchmark runs on, and pinning it there (`dsa bench --cpus`).

On a GPU machine the host work of a decoded token (graph launch, input copies, the inputs' fill) is a tenth of a
small model's token, and it took two levels from process to process with the same code (docs/RESULTS.md §4v: the
launch part 104-125 or 160-162 µs per 1B token). One guess was a process landing on a socket far from the GPU; the
device machine of §4w turned out to have one NUMA node, and the two levels stayed. So each bench row records the CPU
and NUMA node its process last ran on, and --cpus pins the sweep (variant processes inherit it) to a CPU list, e.g.
the GPU's local cores from `nvidia-smi topo -m` on a machine with several.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import BadInputError


def parse_cpu_list(spec: str) -> set[int]:
    """`0-7,16,18-19` as a set of CPU numbers (one-line BadInputError on anything else)."""
    cpus: set[int] = set()
    for part in (p.strip() for p in str(spec).split(",")):
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise BadInputError(f"--cpus: {part!r} is not a CPU number or range (e.g. 0-7,16)") from None
        if a < 0 or b < a:
            raise BadInputError(f"--cpus: {part!r} is not a CPU number or range (e.g. 0-7,16)")
        cpus.update(range(a, b + 1))
    return cpus


def check(spec: str) -> set[int]:
    """The CPUs of `spec`, all of them available to this process (else a one-line BadInputError)."""
    cpus = parse_cpu_list(spec)
    allowed = os.sched_getaffinity(0)
    missing = sorted(cpus - allowed)
    if missing:
        raise BadInputError(f"--cpus: CPU {missing[0]} is not available to this process "
                            f"(available: {format_cpu_list(allowed)})")
    return cpus


def pin(spec: str) -> None:
    """Restricts this process (and the processes it starts later) to the CPUs of `spec`."""
    os.sched_setaffinity(0, check(spec))


def format_cpu_list(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    runs: list[list[int]] = []          # [first, last] of each run of consecutive CPUs
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _numa_node(cpu: int) -> int | None:
    for p in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"):
        return int(p.name[4:])
    return None


def where() -> dict:
    """{"cpu": the CPU this process last ran on, "node": its NUMA node (None if unknown), "affinity": '0-15'}."""
    cpu = None
    try:   # /proc/self/stat field 39 (processor); the command name (field 2) may hold spaces, so split after ')'
        cpu = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        pass
    return {"cpu": cpu, "node": None if cpu is None else _numa_node(cpu),
            "affinity": format_cpu_list(os.sched_getaffinity(0))}
