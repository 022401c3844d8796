"""`shared/` is the contracts library every image installs, including ones without torch: importing any of
its modules must not import torch (heavy imports belong inside the functions that need them).

    pytest -q tests/component/test_infra_shared_imports.py
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import importlib, json, pkgutil, sys
import shared
names = [m.name for m in pkgutil.walk_packages(shared.__path__, "shared.")]
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in ("torch", "transformers", "verl", "vllm") if m in sys.modules)
print(json.dumps({"modules": names, "heavy": heavy}))
"""


def test_every_shared_module_imports_without_torch():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"a shared module failed to import:\n{out.stderr[-3000:]}"
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"shared.platform.bus", "shared.contracts.messages.codec", "shared.contracts.db.models"} <= set(report["modules"])
    assert report["heavy"] == [], f"importing shared pulled in {report['heavy']}; import them inside functions"
