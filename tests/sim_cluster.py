"""Helpers of the reliability tests (validation, fuzz, load): clusters of SIMULATED workers (no torch in
the worker processes: cheap on a shared CPU), metrics scraping, bounded waits."""
from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from client import Client
from client.launcher import LocalCluster, free_port

WAIT_S = 60.0  # bound of a functional wait (generous: the machine is shared)
# The scheduler tree the service suites run against: two front-ends on the one port, an engine per worker group.
TREE_ARGS = ["--frontends", "2", "--engines", "2"]


def config_only_model(out: Path, preset: str = "qwen3-tiny") -> Path:
    """config.json and the real Qwen tokenizer: all the scheduler and a simulated worker read."""
    from bench.common import write_config_only

    return write_config_only(preset, out)


def start_simulated(model_dir: Path, log_dir: Path, *, num_workers: int = 1, worker_args: list[str] = (),
                    scheduler_args: list[str] = ()) -> LocalCluster:
    return LocalCluster(model_dir, num_workers=num_workers, worker_command="simulate",
                        worker_args=list(worker_args), scheduler_args=[*TREE_ARGS, *scheduler_args],
                        log_dir=log_dir).start(timeout=120)


def wait_for(what: str, condition: Callable[[], object], timeout: float = WAIT_S, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached after {timeout} s")
        time.sleep(interval)


def workers(c: Client) -> list[dict]:
    return c.model_info()["workers"]


def all_idle(c: Client) -> bool:
    """Every worker's blocks free (cached-but-free ones count) and nothing running or queued."""
    return all(w["free_blocks"] == w["num_blocks"] and w["num_running"] == 0 and w["num_waiting"] == 0
               for w in workers(c))


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics endpoint: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def sample(samples: dict, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (a service adds model_name to each)."""
    want = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and want <= set(have))


__all__ = ["WAIT_S", "all_idle", "config_only_model", "free_port", "sample", "scrape", "start_simulated",
           "wait_for", "workers"]
