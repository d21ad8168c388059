"""A peer server's process for `bench peers`: started in its own process group and stopped
whole, readiness polling, its version, and how busy the machine is around it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

BUSY_SAMPLE_S = 1.0  # the window of `cpu_busy` in each load snapshot


class ServerFailed(RuntimeError):
    """A server exited or never answered."""


def cpu_busy(interval_s: float = 1.0) -> float:
    """Fraction of all cores busy over `interval_s` (from /proc/stat; 0 where it is missing).
    Unlike the load average it does not lag behind the previous server."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    try:
        t0, i0 = sample()
        time.sleep(interval_s)
        t1, i1 = sample()
    except (OSError, ValueError):
        return 0.0
    return 0.0 if t1 == t0 else 1.0 - (i1 - i0) / (t1 - t0)


def load_snapshot() -> dict[str, float]:
    one, five, fifteen = os.getloadavg()
    return {"load1": one, "load5": five, "load15": fifteen, "cpu_busy": round(cpu_busy(BUSY_SAMPLE_S), 3)}


def quiet_warning(snapshot: Mapping[str, float], cores: int, per_core: float = 0.5) -> str | None:
    """A warning when the machine is not quiet: the cores' busy share above `per_core`.

    NOTE: the 1-minute load average is recorded but does not decide: right after the previous
    server's measurement it still reads ~1.5 on an idle 2-core machine (it decays over minutes)."""
    if snapshot["cpu_busy"] > per_core:
        return (
            f"machine not quiet: load {snapshot['load1']:.2f} on {cores} cores, "
            f"{snapshot['cpu_busy']:.0%} busy; figures are not comparable with a quiet run"
        )
    return None


def run_version(argv: Sequence[str], env: Mapping[str, str]) -> str:
    try:
        done = subprocess.run(list(argv), env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__})"
    lines = [ln.strip() for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    version = [ln for ln in lines if "version" in ln.lower()] or lines
    if not version or done.returncode != 0:
        return f"unknown (exit {done.returncode})"
    return version[-1].removeprefix("version:").strip()


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the server's whole process group, SIGKILL it after `grace_s`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    # Children (vLLM's engine core, for one) may outlive the leader: kill what is left.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def running(argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The server, in a new session (its own process group: Ctrl-C reaches only us, and the
    group is stopped whatever happens inside the block)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(argv),
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        stop_group(proc)


def _tail(path: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log_path: Path) -> float:
    """Poll GET `url` until it answers 200; the seconds it took. Fails at once if the process
    exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise ServerFailed(f"exited with {proc.returncode} before answering:\n{_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return time.monotonic() - t0
        time.sleep(0.5)
    raise ServerFailed(f"no answer at {url} within {timeout_s:g}s:\n{_tail(log_path)}")
