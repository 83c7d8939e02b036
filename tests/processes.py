"""Bounded child processes for the multi-process tests: every child is stopped by its own
process id when the time runs out, whatever happened."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from collections.abc import Sequence

import pytest


def jax_children(what: str) -> list:
    """The markers of a test whose children run JAX whatever this run's backend (``what``: what
    they are): launched once, from the PyTorch run, the shortest suite; skipped where jax is
    not installed."""
    return [
        pytest.mark.only_on("torch", reason=(
            f"subprocess test: {what} are launched once, from the PyTorch run (the shortest "
            "suite; the parent's backend plays no part)")),
        pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                           reason="needs jax (pip install pergrad[jax])"),
    ]


def run_bounded(commands: Sequence[Sequence[str]], timeout: float,
                env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Start every command at once, wait for all of them for at most ``timeout`` seconds in
    all, and return their results in order. Raises ``subprocess.TimeoutExpired`` when time runs
    out; every child still running is then killed by its pid."""
    procs = [subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for command in commands]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout,
                                                       stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
    return results
