"""Log set-up shared by the scheduler and the worker: one JSON object per line (default) or plain text.

JSON lines carry `time` (UTC, ISO 8601), `level`, `logger`, `message`, every field given through
`extra=` (e.g. `log.info("...", extra={"request_id": rid, "completion_tokens": 12})`) and, with an
exception, `exc_info` (the formatted traceback). Text lines append the extra fields as `key=value`.

Standard library only: one module keeps the services' log formats from drifting apart.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

FORMATS = ("json", "text")
ENV_VAR = "SPLITSERVE_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


def extra_fields(record: logging.LogRecord) -> dict:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in extra_fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc_info"] = record.exc_text
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = extra_fields(record)
        if not extra:
            return line
        head, sep, rest = line.partition("\n")  # fields before any traceback
        return head + "".join(f" {k}={v}" for k, v in extra.items()) + sep + rest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", choices=FORMATS, default=os.environ.get(ENV_VAR, "json"),
                        help=f"json: one object per line (default, or ${ENV_VAR}); text: plain lines")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def setup(log_format: str = "json", level: str | int = "INFO") -> None:
    """Replaces the root logger's handlers with one to stderr in the chosen format."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, handlers=[handler], force=True)
