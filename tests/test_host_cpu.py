"""dsa_convert/eval/host_cpu.py: CPU lists, where the process runs, --cpus checks (no backend)."""
from __future__ import annotations

import os

import pytest

from dsa_convert.errors import BadInputError
from dsa_convert.eval import host_cpu


def test_cpu_list_round_trip():
    assert host_cpu.parse_cpu_list("0-2,5, 7-8") == {0, 1, 2, 5, 7, 8}
    assert host_cpu.format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert host_cpu.format_cpu_list({3}) == "3"
    for bad in ("", "a", "1-", "-1", "3-1", "1,,2"):
        with pytest.raises(BadInputError, match="--cpus"):
            host_cpu.parse_cpu_list(bad)


def test_where_names_an_allowed_cpu():
    w = host_cpu.where()
    allowed = os.sched_getaffinity(0)
    assert w["cpu"] in allowed and w["affinity"] == host_cpu.format_cpu_list(allowed)
    assert w["node"] is None or w["node"] >= 0


def test_check_rejects_cpus_outside_the_affinity():
    allowed = os.sched_getaffinity(0)
    assert host_cpu.check(host_cpu.format_cpu_list(allowed)) == allowed
    with pytest.raises(BadInputError, match="CPU 100000 is not available"):
        host_cpu.check("100000")
