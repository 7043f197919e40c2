"""`dsa serve`: the patched llama-server (built by `dsa backend build`) on a DSA GGUF, with the kv overrides of the
attention mode and KV cache asked for. Waits until /health answers ok, prints the URL, forwards SIGINT / SIGTERM to
the server and exits with its status. The server runs in a session of its own (a Ctrl-C reaches it once, through
this process) and is sent SIGTERM if this process dies."""
from __future__ import annotations

import ctypes
import errno
import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from ..backend.runtime import tool_path
from ..errors import BadInputError, DsaError
from ..resources import check_threads
from .session import SessionPlan

STOP_GRACE = 30.0                  # seconds a stopped server gets to exit before it is killed
CACHE_TYPE = {"f32": "f32", "f16": "f16", "q8_0": "q8_0", "q4_0": "q4_0", "asq": "f16"}   # asq: the file's switch


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int = 1                  # server slots; each gets the plan's context
    threads: int | None = None
    ready_timeout: float = 600.0       # seconds to wait for /health
    verbose: bool = False              # llama.cpp's own load log too (-lv 4: the "sparse attention: ..." lines)


def check_serve_options(o: ServeOptions) -> None:
    if not 1 <= o.port <= 65535:
        raise BadInputError(f"--port must be in 1 .. 65535 (got {o.port})")
    if o.parallel < 1:
        raise BadInputError(f"--parallel must be >= 1 (got {o.parallel})")
    check_threads(o.threads)


def check_port_free(host: str, port: int) -> None:
    """One-line refusal of a port something already listens on (llama-server would fail after loading the model)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise BadInputError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise BadInputError(f"port {port} on {host} is in use") from None
            raise BadInputError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def override_arg(overrides: dict) -> list[str]:
    """llama.cpp's `--override-kv KEY=TYPE:VALUE,...` for the plan's overrides."""
    items = []
    for k, v in overrides.items():
        if isinstance(v, bool):
            items.append(f"{k}=bool:{'true' if v else 'false'}")
        elif isinstance(v, int):
            items.append(f"{k}=int:{v}")
        elif isinstance(v, float):
            items.append(f"{k}=float:{v!r}")
        else:
            items.append(f"{k}=str:{v}")
    return ["--override-kv", ",".join(items)] if items else []


def server_argv(exe: str, plan: SessionPlan, o: ServeOptions) -> list[str]:
    ct = CACHE_TYPE[plan.kv]
    argv = [exe, "-m", str(plan.path), "--host", o.host, "--port", str(o.port),
            "-c", str(plan.n_ctx * o.parallel), "-np", str(o.parallel),       # n_ctx is split among the slots
            "-fa", "on" if plan.flash_attn else "off", "-ctk", ct, "-ctv", ct, "--no-webui",
            *override_arg(plan.overrides)]
    if plan.n_gpu_layers:
        argv += ["-ngl", str(plan.n_gpu_layers)]
    if o.verbose:
        argv += ["-lv", "4"]            # llama.cpp's INFO lines are the server's verbosity 4
    if o.threads:
        argv += ["-t", str(o.threads), "-tb", str(o.threads)]
    return argv


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def health(url: str, timeout: float = 2.0) -> str | None:
    """/health's status ("ok", "loading model", …) or None when nothing answers."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return json.loads(r.read() or b"{}").get("status", "ok")
    except urllib.error.HTTPError as e:
        try:
            return json.loads(e.read() or b"{}").get("error", {}).get("message", f"HTTP {e.code}")
        except (ValueError, AttributeError):
            return f"HTTP {e.code}"
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def serve(plan: SessionPlan, o: ServeOptions, say: Callable[[str], None]) -> int:
    """Run llama-server until it exits or is stopped; returns its exit status (128 + N for signal N)."""
    check_serve_options(o)
    check_port_free(o.host, o.port)
    exe, env = tool_path("llama-server")
    argv = server_argv(str(exe), plan, o)
    host = f"[{o.host}]" if ":" in o.host else o.host
    url = f"http://{host}:{o.port}"
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_die_with_parent)
    stop_at: list[float] = []

    def forward(signum, frame):
        stop_at.append(time.monotonic())
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        t0 = time.monotonic()
        while proc.poll() is None and not stop_at:
            if health(url) == "ok":
                print(f"{url}/v1", flush=True)           # stdout: the URL alone (the OpenAI client's base_url)
                say(f"llama-server (pid {proc.pid}) serves {plan.path.name} at {url}/v1: {plan.describe()} attention, "
                    f"KV {plan.kv}, ctx {plan.n_ctx} x {o.parallel} slots; Ctrl-C or SIGTERM stops it")
                break
            if time.monotonic() - t0 > o.ready_timeout:
                raise DsaError(f"llama-server did not answer /health within {o.ready_timeout:.0f} s; stopped it")
            time.sleep(0.2)
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stop_at and time.monotonic() - stop_at[0] > STOP_GRACE:
                    proc.kill()                           # asked to stop and still running: no server left behind
    finally:
        if proc.poll() is None:                           # an error on the way out: no server left behind
            proc.terminate()
            try:
                proc.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sig, h in old.items():
            signal.signal(sig, h)
    rc = 128 - rc if rc < 0 else rc
    if not stop_at and rc != 0:
        raise DsaError(f"llama-server exited with status {rc} (its log is above)")
    return rc
