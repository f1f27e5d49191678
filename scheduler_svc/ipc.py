"""The transport inside the scheduler's process tree: ZeroMQ PUSH/PULL over IPC sockets, one inbox (PULL) per
process, msgpack messages. A message is a list whose first item names it; token ids, request keys and block
hashes travel as packed little-endian arrays (bytes), never as one Python object per token.

Each process binds its inbox at a fixed path of the run folder (`<run_dir>/<name>.ipc`) and connects one PUSH
socket per peer it writes to, so a process that is replaced binds the same path and its peers reconnect by
themselves. A PUSH socket queues without bound (SNDHWM 0): the supervisor notices a dead peer and its traffic
ends; a slow peer is never dropped from. Sockets are not thread-safe: each thread has its own.
"""
from __future__ import annotations

import os
import signal
import threading
from array import array
from pathlib import Path

import msgpack
import setproctitle
import zmq
import zmq.asyncio

SUPERVISOR = "supervisor"


def frontend_name(index: int) -> str:
    return f"frontend-{index}"


def engine_name(index: int) -> str:
    return f"engine-{index}"


def endpoint(run_dir: str | Path, name: str) -> str:
    return f"ipc://{Path(run_dir) / name}.ipc"


def pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def ints(values, typecode: str = "q") -> bytes:
    """Packs ints (int64: "q"; int32: "i"; uint64: "Q") for a message."""
    return array(typecode, values).tobytes()


def unints(data: bytes, typecode: str = "q") -> array:
    out = array(typecode)
    out.frombytes(data)
    return out


def floats(values) -> bytes:
    return array("f", values).tobytes()


def unfloats(data: bytes) -> array:
    out = array("f")
    out.frombytes(data)
    return out


class Outboxes:
    """PUSH sockets to peers by name, connected on first use (blocking sockets: one thread's)."""

    def __init__(self, context: zmq.Context, run_dir: str | Path):
        self._context, self._run_dir = context, run_dir
        self._sockets: dict[str, zmq.Socket] = {}

    def socket(self, name: str) -> zmq.Socket:
        s = self._sockets.get(name)
        if s is None:
            s = self._context.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint(self._run_dir, name))
            self._sockets[name] = s
        return s

    def send(self, name: str, message: list) -> None:
        self.socket(name).send(pack(message))

    def send_bytes(self, name: str, data: bytes) -> None:
        self.socket(name).send(data)

    def close(self, linger_ms: int = 2000) -> None:
        """Closes the sockets once what they queued has gone out (or after linger_ms: a peer may be dead)."""
        for s in self._sockets.values():
            s.close(linger_ms)
        self._sockets.clear()


def inbox(context: zmq.Context | zmq.asyncio.Context, run_dir: str | Path, name: str):
    """The PULL socket this process reads its messages from."""
    s = context.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(endpoint(run_dir, name))
    return s


def become_child(title: str, parent) -> None:
    """What a child of the supervisor does first: takes a process title (`ps`, `top`: `splitserve-scheduler
    frontend 0`), leaves Ctrl-C (sent to the whole process group) to the supervisor, and exits when the
    supervisor's end of the pipe `parent` closes (it died)."""
    setproctitle.setproctitle(f"splitserve-scheduler {title}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        try:
            parent.recv()
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="supervisor-watch").start()
