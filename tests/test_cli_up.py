"""The README's first command from a fresh clone: `scripts/up.sh` (`splitserve up` on the embedded default
model, written on first use into an empty $SPLITSERVE_CACHE) starts a scheduler and a worker, streams a
sample and prints a `splitserve generate` line; that line works; Ctrl-C stops everything it started."""
from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from client.launcher import free_port, health_status

pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
READY_S = 240.0  # writing the default checkpoint, then two processes importing torch, on 2 cores
STOP_S = 45.0  # LocalCluster.stop gives the scheduler, then the worker, up to 15 s each before killing them


def _children(pid: int) -> set[int]:
    """Processes whose parent is pid (from /proc; the services run in sessions of their own)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class _Lines:
    """Lines of a pipe, read on a thread so every wait for one is bounded."""

    def __init__(self, pipe):
        self.seen: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"output ended before {prefix!r}:\n{''.join(self.seen)}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no {prefix!r} line after {timeout} s:\n{''.join(self.seen)}")


def test_up_then_generate_then_ctrl_c(tmp_path):
    env = {**os.environ, "SPLITSERVE_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("SPLITSERVE_ADDRESS", None)
    port = free_port()
    up = subprocess.Popen(["bash", "scripts/up.sh", "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
    children: set[int] = set()
    try:
        lines = _Lines(up.stdout)
        sample = lines.wait_for("sample", READY_S)
        serving = lines.wait_for("serving at", 120)
        try_line = lines.wait_for("try:", 10)
        children = _children(up.pid)
        assert len(children) == 2, children  # the scheduler and the worker
        assert len(sample.split(":", 1)[1].strip()) > len("The capital of France is"), sample
        address = f"127.0.0.1:{port}"
        assert address in serving and address in try_line
        worker = re.search(r"worker at (127\.0\.0\.1:\d+)", serving).group(1)
        assert health_status(worker) == "SERVING"
        assert list((tmp_path / "cache").rglob("model*.safetensors")), "the default model was not written"

        # The line `up` prints, as a user would paste it.
        command = shlex.split(try_line.split(":", 1)[1])
        assert command[0] == "splitserve"
        done = subprocess.run(command + ["--max-tokens", "8"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip(), "no text printed"

        up.send_signal(signal.SIGINT)
        assert up.wait(STOP_S) == 0, "".join(lines.seen)
        assert health_status(address, timeout=1.0) == "UNAVAILABLE"
        assert health_status(worker, timeout=1.0) == "UNAVAILABLE"
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in children if _alive(p)], "up left child processes behind"
    finally:
        for pid in [*children, up.pid]:  # only what this test started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        up.wait(10)


LAUNCHER = """
import sys, time
from client.launcher import LocalCluster

cluster = LocalCluster(sys.argv[1], worker_command="simulate", log_dir=sys.argv[2]).start(120)
print("pids", *[p.popen.pid for p in cluster.processes], flush=True)
time.sleep(600)
"""


def test_services_end_with_a_launcher_killed_without_stopping_them(tiny_model_dir, tmp_path):
    """A launcher killed outright (SIGKILL: no `finally`, no stop()) leaves no service behind holding its port
    (or, on a GPU, its memory): each sees its parent gone and shuts itself down (common/lifetime.py)."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tiny_model_dir), str(tmp_path)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pids: list[int] = []
    try:
        lines = _Lines(launcher.stdout)
        pids = [int(p) for p in lines.wait_for("pids", 150).split()[1:]]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + STOP_S
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], "services outlived their launcher"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
