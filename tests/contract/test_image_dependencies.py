"""Every service's image holds every third-party distribution the service can import: the service's import
closure (first-party modules reached from its entry point through `import` statements, function-level ones
included, and through the "pkg.module:attr" strings the registries resolve at run time) against the closure of
the image's requirement set (pyproject core + the Dockerfile's extras + torch, expanded through installed
package metadata with extras and markers). No image is built: this runs in a second.

A few libraries need a distribution only for one of their submodules (SQLAlchemy's asyncio extension needs
greenlet, which is not a default dependency since SQLAlchemy 2.1): IMPLIED lists them. The images in
docker-compose.yml lacked greenlet that way, and controller, jobs and weight-server crashed at start.

    pytest -q tests/contract/test_image_dependencies.py
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"shared", "services", "infra"}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.gpu.yml"]
MODULE_STRING = re.compile(r"^((?:shared|services|infra)(?:\.\w+)+)(?::\w+)?$")

# submodule imported -> distribution it needs that its own package does not declare by default
IMPLIED = {"sqlalchemy.ext.asyncio": "greenlet"}

# Requirements of distributions that cannot be installed next to the dev environment (so their metadata is
# not here to expand): vLLM pins its own torch (see infra/docker/rollout-gpu.Dockerfile).
NOT_INSTALLABLE_HERE = {"vllm": ["torch"]}

# (dockerfile or "*", distribution) pairs a service may lack in that image, with why: code paths it never runs.
OPTIONAL = {
    ("infra/docker/base.Dockerfile", "vllm"): "engine.type = vllm runs only in the GPU rollout image",
    ("*", "wandb"): "metrics sync to W&B only when configured; the user installs the client (services/jobs/tracking.py)",
    ("*", "mlflow"): "metrics sync to MLflow only when configured; the user installs the client",
    ("*", "triton"): "the trainer's Triton log-prob kernel runs on CUDA, where torch's CUDA build brings triton; "
                     "without it the trainer keeps verl's torch kernel (services/trainer/logprob_kernel.py)",
    # `import mlflow` resolves to mlflow-skinny where the trainer extra installed it (services/trainer/tracking.py)
    ("*", "mlflow-skinny"): "the jobs worker's MLflow sync, only when configured; the user installs the client",
    # The registries name every built-in env and reward; the trainer never resolves them (env workers and
    # rollout workers do), so the trainer image has no `envs` extra.
    ("infra/docker/trainer.Dockerfile", "math-verify"): "built-in rewards run in env/rollout workers",
    ("infra/docker/trainer.Dockerfile", "gymnasium"): "built-in envs run in env workers",
    ("infra/docker/trainer.Dockerfile", "rank-bm25"): "built-in search tool runs in env workers",
    ("infra/docker/trainer.Dockerfile", "pyseccomp"): "the sandbox of model-written code runs in env workers",
    ("infra/docker/trainer.Dockerfile", "docker"): "the sandbox's container mode runs in env workers",
}


# -- the service side: what it imports ---------------------------------------------------------------------
def module_file(name: str) -> Path | None:
    path = REPO.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


@functools.cache
def imports_of(module: str) -> tuple[str, ...]:
    """Dotted names a first-party module imports anywhere in its body, plus module paths named in strings."""
    path = module_file(module)
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module
            out += [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := MODULE_STRING.match(node.value)):
            out.append(m.group(1))
    return tuple(out)


def third_party_imports(entry: str) -> dict[str, set[str]]:
    """Third-party dotted names the entry module can reach -> the first-party modules importing them."""
    seen: set[str] = set()
    found: dict[str, set[str]] = {}
    todo = [entry]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in imports_of(module):
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                if module_file(name):
                    todo.append(name)
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(name, set()).add(module)
    return found


@functools.cache
def distributions_of_module() -> dict[str, list[str]]:
    return {k: [canonicalize_name(d) for d in v] for k, v in md.packages_distributions().items()}


@functools.cache
def modules_of(dist: str) -> set[str]:
    """Dotted names of the modules and packages a distribution installs."""
    out = set()
    for f in md.distribution(dist).files or []:
        if f.suffix == ".py":
            out.add(".".join(f.with_suffix("").parts).removesuffix(".__init__"))
    return out


def needed_distributions(entry: str) -> dict[str, set[str]]:
    """Distribution -> first-party modules that need it (a module not installed here counts as its own name)."""
    needed: dict[str, set[str]] = {}
    for name, importers in third_party_imports(entry).items():
        top = name.split(".")[0]
        dists = distributions_of_module().get(top, [canonicalize_name(top)])
        if len(dists) > 1:  # a namespace package (opentelemetry): only the distributions holding this very module
            dists = [d for d in dists if name in modules_of(d)]
        for dist in dists:
            needed.setdefault(dist, set()).update(importers)
        for prefix, dist in IMPLIED.items():
            if name == prefix or name.startswith(prefix + "."):
                needed.setdefault(canonicalize_name(dist), set()).update(importers)
    return needed


# -- the image side: what it installs ----------------------------------------------------------------------
def dockerfile_requirements(dockerfile: str, core: list[str]) -> list[str]:
    """Core dependencies + the extras the Dockerfile installs (`ARG EXTRAS=` or `.[a,b]`) + the requirement files
    it installs (`-r infra/...txt`) + torch."""
    text = (REPO / dockerfile).read_text()
    extras = set()
    for match in re.findall(r"^ARG EXTRAS=([\w,-]+)", text, re.M) + re.findall(r'"\.\[([\w,-]+)\]"', text):
        if match != "${EXTRAS}":
            extras.update(match.split(","))
    unknown = extras - set(PYPROJECT["optional-dependencies"])
    assert not unknown, f"{dockerfile}: extras not in pyproject.toml: {unknown}"
    reqs = list(core) + [r for e in sorted(extras) for r in PYPROJECT["optional-dependencies"][e]]
    for path in re.findall(r"-r (infra/[\w./-]+\.txt)", text):
        reqs += [line.split("#")[0].strip() for line in (REPO / path).read_text().splitlines()
                 if line.split("#")[0].strip()]
    if re.search(r"pip install .*\btorch==", text):
        reqs.append("torch")
    return reqs


def requirement_closure(requirements: list[str]) -> set[str]:
    """Every distribution pip would install for `requirements`, from the metadata of the packages installed
    here (the dev environment has every extra). A requirement not installed here ends the walk at its name."""
    closure: dict[str, set[str]] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        wanted = set(req.extras)
        if name in closure and wanted <= closure[name]:
            continue
        closure[name] = closure.get(name, set()) | wanted
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            requires = NOT_INSTALLABLE_HERE.get(name, [])
        for line in requires:
            sub = Requirement(line)
            if sub.marker and not any(sub.marker.evaluate({"extra": e}) for e in closure[name] | {""}):
                continue
            todo.append(sub)
    return set(closure)


# -- compose: which service runs in which image ------------------------------------------------------------
def service_images() -> list[tuple[str, str, str]]:
    """(service, dockerfile, entry module) for every flywheel service of every compose file."""
    scripts = PYPROJECT["scripts"]
    out = set()
    base = yaml.safe_load((REPO / COMPOSE_FILES[0]).read_text())["services"]
    for name in COMPOSE_FILES:  # an override file's service inherits what it does not set
        for service, spec in yaml.safe_load((REPO / name).read_text())["services"].items():
            spec = {**base.get(service, {}), **spec}
            build, command = spec.get("build"), spec.get("command")
            if not build or not command:
                continue
            argv = list(command)
            if "torchrun" in argv[0]:
                argv = argv[argv.index("-m"):]
            module = argv[1] if argv[0] in ("python", "-m") else scripts[argv[0]].split(":")[0]
            if argv[0] == "python":
                module = argv[2]
            out.add((service, build["dockerfile"], module))
    return sorted(out)


def missing(dockerfile: str, entry: str, core: list[str] | None = None) -> dict[str, set[str]]:
    installed = requirement_closure(dockerfile_requirements(dockerfile, core or PYPROJECT["dependencies"]))
    return {dist: mods for dist, mods in needed_distributions(entry).items()
            if dist not in installed and (dockerfile, dist) not in OPTIONAL and ("*", dist) not in OPTIONAL}


SERVICE_IMAGES = service_images()


def test_every_service_and_image_is_covered():
    services = {s for s, _, _ in SERVICE_IMAGES}
    assert {"api", "jobs", "controller", "env-worker", "weight-server", "rollout-worker", "trainer", "migrate",
            "model-init"} <= services
    dockerfiles = {d for _, d, _ in SERVICE_IMAGES}
    assert {"infra/docker/base.Dockerfile", "infra/docker/trainer.Dockerfile",
            "infra/docker/rollout-gpu.Dockerfile"} <= dockerfiles


@pytest.mark.parametrize("service,dockerfile,entry", SERVICE_IMAGES,
                         ids=[f"{s}@{Path(d).stem}" for s, d, _ in SERVICE_IMAGES])
def test_image_installs_every_distribution_the_service_imports(service, dockerfile, entry):
    assert module_file(entry), f"{service}: entry module {entry} does not exist"
    lacking = missing(dockerfile, entry)
    assert not lacking, (f"{service} ({entry}) imports distributions {dockerfile} does not install: "
                         + "; ".join(f"{d} (imported by {', '.join(sorted(m))})" for d, m in sorted(lacking.items()))
                         + ". Add them to the image's extras in pyproject.toml.")


def test_the_check_finds_greenlet_missing_for_sqlalchemy_asyncio(monkeypatch):
    """A service importing SQLAlchemy's asyncio extension needs greenlet, which plain `sqlalchemy` does not
    install: the check must report it (no service imports it today; the images once crashed on it)."""
    monkeypatch.setitem(globals(), "third_party_imports", lambda entry: {"sqlalchemy.ext.asyncio": {"shared.x"}})
    assert needed_distributions("shared.x")["greenlet"] == {"shared.x"}
    assert "greenlet" not in requirement_closure(["sqlalchemy>=2.0.30"])
    assert "greenlet" in requirement_closure(["sqlalchemy[asyncio]>=2.0.30"])


def test_the_check_finds_an_extra_the_image_lacks():
    """The trainer image has no `envs` extra: a service there importing the math grader would be caught."""
    needed = needed_distributions("services.env_worker.builtin.rewards")
    assert "math-verify" in needed
    installed = requirement_closure(dockerfile_requirements("infra/docker/trainer.Dockerfile",
                                                            PYPROJECT["dependencies"]))
    assert "math-verify" not in installed and "verl" in installed and "torch" in installed


def test_the_check_names_the_distributions_of_a_namespace_package():
    """`opentelemetry` is one namespace over many distributions: each import needs the one holding its module,
    not every distribution installed under the namespace (the Prometheus exporter, which no service imports)."""
    needed = needed_distributions("shared.platform.tracing")
    otel = {d for d in needed if d.startswith("opentelemetry")}
    assert otel == {"opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"}, otel
