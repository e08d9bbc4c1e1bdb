"""Commands the suite runs as their users would, from the shell, in the background.

A command that spends its time in processes of its own (an example under torchrun, a benchmark,
``scripts/gpu_check.py``: each rank pays for its imports) need not hold up the rest of the suite.
A test module lists its commands by the test, or the fixture, that reads them::

    LAUNCHES = {"test_name": [Launch("label", [sys.executable, ...], seconds=15)],
                "fixture_name": [...]}

When collection ends, conftest starts the selected tests' commands one at a time, the costliest
first, beside the rest of the suite (mostly one process, which leaves a core idle), and runs the
tests that read them last, in that order. A test reads a command with the ``launches`` fixture:
``launches.result(label)`` (exit status, stdout, stderr), ``launches.output(label)`` (stdout of a
command that must succeed) and ``launches.folder(label)``, its own working folder, which
``{out}`` in its arguments names too. Where a test judges measured times (a speed tracker
telling a straggler from noise), the ``background`` fixture's ``paused()`` stops the commands
while it runs (``shared_spawn(..., quiet=True)`` for a group of distributed cases).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

# Every command must end within this (seconds) of the session's start: alone they take about
# three minutes in all, beside the rest of the suite on a 2-core machine about twice that.
# Tests that read them get pytest-timeout's limit just above it.
TIMEOUT_S = 1500

# One command at a time beside the rest of the suite: each keeps about 1.8 cores busy (its ranks'
# imports, then their steps). The whole suite on this 2-core machine, warm caches, with only the
# examples in the background: all at once 263.8 s, two at a time 264.3 s, one at a time 251.8 s
# (26 ranks at once thrash). Once a test waits on a command nothing else runs: two at a time.
AT_ONCE = 1
AT_ONCE_WAITING = 2


class Launch(NamedTuple):
    label: str          # unique in the session
    argv: list[str]     # "{out}" in an argument is replaced by the command's working folder
    seconds: float      # about how long it takes alone (2-core machine): the costliest go first


def _skipped(item) -> bool:
    return any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0])
               for m in item.iter_markers())


def launches_of(item) -> list[Launch]:
    """The commands a collected test reads, itself or through its fixtures (none when it is
    skipped)."""
    table = getattr(getattr(item, "module", None), "LAUNCHES", None)
    if not table or _skipped(item):
        return []
    names = [getattr(item, "originalname", None), *getattr(item, "fixturenames", ())]
    return [launch for name in names if name in table for launch in table[name]]


class Launches:
    """The selected tests' commands, started in the background, at most ``AT_ONCE`` at a time
    (``AT_ONCE_WAITING`` once a test waits on one)."""

    def __init__(self, items) -> None:
        queue: dict[str, Launch] = {}
        for item in items:
            for launch in launches_of(item):
                if queue.setdefault(launch.label, launch) != launch:
                    raise ValueError(f"two commands are labelled {launch.label!r}")
        self.queue = sorted(queue.values(), key=lambda launch: -launch.seconds)
        self.root = Path(tempfile.mkdtemp(prefix="moebalance-launches-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.done: dict[str, tuple[int, str, str]] = {}
        self.deadline = time.monotonic() + TIMEOUT_S
        self.closed = threading.Event()
        self.pause = threading.Event()
        self.at_once = AT_ONCE
        self.starter = threading.Thread(target=self._start_in_turn, daemon=True)
        self.starter.start()

    def order(self, label: str) -> int:
        """Where a command stands in the queue."""
        return [launch.label for launch in self.queue].index(label)

    def folder(self, label: str) -> Path:
        return self.root / "".join(c if c.isalnum() else "_" for c in label)

    def _start_in_turn(self) -> None:
        for launch in self.queue:
            while self.pause.is_set() \
                    or sum(p.poll() is None for p in self.procs.values()) >= self.at_once:
                if self.closed.wait(0.2):
                    return
            if self.closed.is_set():
                return
            folder = self.folder(launch.label)
            folder.mkdir()
            argv = [str(a).replace("{out}", str(folder)) for a in launch.argv]
            # Output goes to files: a pipe nobody reads until the test runs could fill and stall.
            with open(folder / "stdout.txt", "w") as stdout, \
                    open(folder / "stderr.txt", "w") as stderr:
                # A session of its own: pausing and killing reach its ranks too.
                self.procs[launch.label] = subprocess.Popen(argv, stdout=stdout, stderr=stderr,
                                                            cwd=folder, text=True,
                                                            start_new_session=True)

    def result(self, label: str) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of one command, waiting for it."""
        if label not in self.done:
            self.at_once = AT_ONCE_WAITING      # the foreground is idle from now on
            while label not in self.procs and self.starter.is_alive() \
                    and time.monotonic() < self.deadline:
                time.sleep(0.2)
            proc = self.procs.get(label)
            if proc is None:
                self.done[label] = (-1, "", f"(not started within {TIMEOUT_S} s)")
                return self.done[label]
            note = ""
            try:
                code = proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                code, note = proc.wait(), f"\n(killed after {TIMEOUT_S} s)"
            folder = self.folder(label)
            self.done[label] = (code, (folder / "stdout.txt").read_text(),
                                (folder / "stderr.txt").read_text() + note)
        return self.done[label]

    def output(self, label: str) -> str:
        """stdout of a command that must succeed."""
        code, out, err = self.result(label)
        assert code == 0, f"{label} failed (exit status {code}):\n{err[-3000:]}"
        return out

    def _signal(self, sig: int) -> None:
        for proc in list(self.procs.values()):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)

    @contextlib.contextmanager
    def paused(self):
        """Stop every running command (and hold back the next) for the duration; the time
        paused is added to the deadline."""
        self.pause.set()
        start = time.monotonic()
        self._signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self._signal(signal.SIGCONT)
            self.deadline += time.monotonic() - start
            self.pause.clear()

    def close(self) -> None:
        self.closed.set()
        self.starter.join()
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
