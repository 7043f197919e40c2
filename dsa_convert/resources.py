"""Resources of this process: the `--threads` check, and peak memory for the `--json` reports of convert and quantize."""
from __future__ import annotations

import resource
import sys

from .errors import BadInputError


def check_threads(threads: int | None) -> None:
    """One-line refusal of a `--threads` below 1 (None: the default, backend.llama_runner.default_threads)."""
    if threads is not None and threads < 1:
        raise BadInputError(f"--threads must be >= 1 (got {threads})")


def peak_rss_mib() -> float:
    """Peak resident set of this process (Linux ru_maxrss is in KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)


def peak_gpu_mib() -> float | None:
    """Peak memory torch allocated on the current CUDA device; None when CUDA was never used."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**20, 1)


def peak_resources() -> dict:
    out = {"peak_rss_mib": peak_rss_mib()}
    gpu = peak_gpu_mib()
    if gpu is not None:
        out["peak_gpu_mib"] = gpu
    return out
