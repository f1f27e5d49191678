"""A service that a launcher started ends with the launcher. client.launcher names its own pid in PARENT_PID_ENV for
the processes it starts; a service that finds it there watches that its parent is still that process and, once it
is not (the launcher was killed, or a test run cut short, without stopping what it started), sends itself SIGTERM:
the shutdown its signal handlers run (drain, deregister, stop). Without this such a process keeps its port and,
on a GPU, all the memory its KV cache took."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

PARENT_PID_ENV = "SPLITSERVE_PARENT_PID"
POLL_S = 0.5


def exit_with_launcher() -> None:
    """Called first thing by a service's main. The variable is taken out of the environment so that the processes
    this one starts in turn (the scheduler's tree, tensor-parallel ranks) do not read it as theirs."""
    named = os.environ.pop(PARENT_PID_ENV, None)
    if not named:
        return
    launcher = int(named)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()


def exit_now(code: int) -> NoReturn:
    """Ends a service that has stopped and closed what it holds, without the interpreter's teardown of torch's and
    gRPC's modules and threads (a good part of a second that a stopped service has no use for). Logs and the
    standard streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
