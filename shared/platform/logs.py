"""One logger setup for every service: JSON lines in containers, readable text on a terminal.

Every record carries the service name; pass run_id / policy_version / step through `extra=`."""

from __future__ import annotations

import json
import logging
import sys
import time

_CONTEXT_KEYS = ("run_id", "policy_version", "step", "task_id", "worker_id")


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3), "level": record.levelname, "service": self.service,
            "logger": record.name, "msg": record.getMessage(),
        }
        for key in _CONTEXT_KEYS:
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _TextFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ctx = " ".join(f"{k}={getattr(record, k)}" for k in _CONTEXT_KEYS if hasattr(record, k))
        line = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname[0]} " \
               f"[{self.service}] {record.getMessage()}" + (f" ({ctx})" if ctx else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(service: str, level: str = "INFO", fmt: str = "auto") -> None:
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(service) if fmt == "json" else _TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "uvicorn.access", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
