"""`flywheel-healthcheck URL`: exit 0 when URL answers 2xx within 3 s, else 1 (the container healthcheck).

A console script rather than `python -c "..."`: podman 4.3 splits exec-form healthcheck arguments that hold
spaces when the command comes through its Docker-compatible API (podman issue 26519)."""

from __future__ import annotations

import sys
import urllib.request


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/healthz"
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            sys.exit(0 if 200 <= response.status < 300 else 1)
    except Exception as exc:  # any failure is "unhealthy"; the reason goes to the healthcheck log
        print(f"{url}: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
