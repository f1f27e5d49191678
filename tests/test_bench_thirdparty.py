"""bench/thirdparty.py without aiperf (a tool of its own venv, not a dependency): the command it runs and how its
report becomes the table's row."""
from __future__ import annotations

from pathlib import Path

from bench import thirdparty

REPORT = {  # the fields of aiperf 0.13's profile_export_aiperf.json that the row reads, as aiperf writes them
    "aiperf_version": "0.13.0",
    "request_count": {"unit": "requests", "avg": 40.0},
    "completed_request_count": {"unit": "requests", "avg": 39.0},
    "benchmark_duration": {"unit": "sec", "avg": 5.0123},
    "request_throughput": {"unit": "requests/sec", "avg": 7.9812},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 510.4},
    "time_to_first_token": {"unit": "ms", "avg": 30.0, "p50": 25.123, "p99": 80.5},
    "inter_token_latency": {"unit": "ms", "avg": 2.0, "p50": 1.91234, "p99": 4.2},
    "inter_chunk_latency": {"unit": "ms", "avg": 2.0, "p50": 1.5, "p99": 9.75},
    "error_summary": [{"code": 500, "count": 1}],
}


def test_the_row_is_aiperfs_figures():
    row = thirdparty.aiperf_row(REPORT)
    assert row == {"client": "aiperf 0.13.0 -> HTTP gateway", "requests": 40, "errors": 1, "seconds": 5.012,
                   "achieved_req_s": 7.98, "output_tokens_per_s": 510, "ttft_p50_ms": 25.12, "ttft_p99_ms": 80.5,
                   "tpot_p50_ms": 1.912, "tpot_p99_ms": 4.2, "gap_p50_ms": 1.5, "gap_p99_ms": 9.75}
    assert thirdparty.aiperf_row({"request_count": {"avg": 3}})["ttft_p50_ms"] is None  # a metric it did not report


def test_the_command_fixes_rate_lengths_and_seed():
    args = thirdparty.build_parser().parse_args(["--simulate", "--aiperf", "/opt/aiperf/bin/aiperf", "--rate", "4",
                                                 "--num-requests", "16", "--input-len", "100", "--output-len", "20"])
    command = thirdparty.aiperf_command(args, "http://127.0.0.1:1", Path("/m"), "model", Path("/out"))
    assert command[:2] == ["/opt/aiperf/bin/aiperf", "profile"]
    pairs = {c: command[i + 1] for i, c in enumerate(command[:-1]) if c.startswith("--")}
    assert pairs["--request-rate"] == "4.0" and pairs["--arrival-pattern"] == "poisson"
    assert pairs["--isl"] == "100" and pairs["--isl-stddev"] == "0" and pairs["--osl"] == "20"
    assert pairs["--request-count"] == "16" and pairs["--random-seed"] == "0" and pairs["--tokenizer"] == "/m"
    assert "--streaming" in command and "ignore_eos:true" in command
