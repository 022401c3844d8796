"""Every link and command in README.md and docs/*.md is real: a relative link resolves to a file (its #anchor to a
heading), `make <target>` is a Makefile target, `python -m <module>` is importable, `flywheel <command>` is a CLI
command, a REST route (`GET /v1/...`) is served by the API, the weight server or a rollout worker, and every
variable in docs/configuration.md's table is a service setting. The SQL queries run in
tests/component/test_sql_docs.py.

    pytest -q tests/contract/test_docs.py
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

from tests.support.markdown import FENCE, slugs

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
METHODS = "GET|POST|PUT|DELETE|PATCH"
OTHER_SERVERS = {"/v1/load_lora_adapter"}  # a vLLM server's routes, which docs/lora.md names


def split_code(text: str) -> tuple[list[str], str]:
    """(every code block and inline code span, the prose with code taken out)."""
    blocks = FENCE.findall(text)
    prose = FENCE.sub("", text)
    spans = re.findall(r"`([^`]+)`", prose)
    return blocks + spans, re.sub(r"`[^`]+`", "", prose)


def links(text: str) -> list[str]:
    _, prose = split_code(text)
    return [t for t in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose) if not re.match(r"[a-z]+:", t)]


def make_targets(text: str) -> set[str]:
    code, _ = split_code(text)
    return {t for c in code for t in re.findall(r"(?<![\w-])make +([a-z][\w-]*)", c)}


def python_modules(text: str) -> set[str]:
    """Modules run with `python -m` or `torchrun ... -m`, except under .venv-vllm's interpreter: vLLM is not in
    the project's venv."""
    code, _ = split_code(text)
    return {m for c in code for run, m in re.findall(r"(\S*python3?|torchrun\b[^\n`]*?) +-m +([\w.]+)", c)
            if ".venv-vllm" not in run}


def cli_commands(text: str) -> set[tuple[str, ...]]:
    """`flywheel runs show <run>` -> ("runs", "show"); `runs pause|resume|stop` -> one tuple each."""
    code, _ = split_code(text)
    out = set()
    for c in code:
        for words in re.findall(r"(?:^|(?<=[\s/]))flywheel((?: +[a-z][a-z|-]*)+)", c, re.M):
            first, *rest = words.split()
            for a in first.split("|"):
                out |= {(a, b) for b in rest[0].split("|")} if rest else {(a,)}
    return out


def rest_routes(text: str) -> set[tuple[str, str]]:
    """(method, path) of every `METHOD /v1/...` in code; a span that is only a path gets method '*'."""
    code, _ = split_code(text)
    out = set()
    for c in code:
        for method, path in re.findall(rf"\b({METHODS}) +(/v1/[^\s`'\",)]*)", c):
            out.add((method, path.split("?")[0]))
        if re.fullmatch(r"/v1/\S+", c.strip()) and c.strip() not in OTHER_SERVERS:
            out.add(("*", c.strip().split("?")[0]))
    return out


def config_variables(text: str) -> set[str]:
    """The variables of the configuration table's first column."""
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    return {v for cell in rows for v in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)}


@cache
def makefile_targets() -> set[str]:
    heads = re.findall(r"^([\w./-]+(?: +[\w./-]+)*) *:(?!=)", (REPO / "Makefile").read_text(), re.M)
    return {t for head in heads for t in head.split()}


@cache
def cli():
    import typer

    from services.api.cli import app
    return typer.main.get_command(app)


@cache
def served_routes() -> set[tuple[str, str]]:
    """(method, path) of every route of the API, the weight server, a rollout worker's relay and its gateway
    (which a session's base URL, `/s/<key>/v1`, reaches as `/v1/...`)."""
    from fastapi import FastAPI

    from services.api.app import create_app
    from services.api.settings import ApiSettings
    from services.rollout_worker.gateway import Gateway
    from services.rollout_worker.weight_relay import relay_router
    from services.weight_server.app import build_router

    app = FastAPI()
    app.include_router(build_router(store=None))  # the store is used per request only
    app.include_router(relay_router(relay=None))
    routes = {(m.upper(), path) for a in (create_app(ApiSettings()), app) for path, ops in a.openapi()["paths"].items()
              for m in ops}
    gateway = Gateway().app.router.routes()
    return routes | {(r.method, r.resource.canonical.removeprefix("/s/{key}")) for r in gateway}


def route_served(method: str, path: str) -> bool:
    """`{x}` / `<x>` in the docs is a parameter, `a|b` alternatives that must each be served, `...` any rest."""
    for doc_path in alternatives(path.rstrip("/").split("/")):
        if not any(method in ("*", m) and path_matches(doc_path, route.split("/")) for m, route in served_routes()):
            return False
    return True


def alternatives(segments: list[str]) -> list[list[str]]:
    if not segments:
        return [[]]
    return [[a, *rest] for a in segments[0].split("|") for rest in alternatives(segments[1:])]


def path_matches(doc: list[str], route: list[str]) -> bool:
    if doc and doc[-1] == "...":
        return len(route) > len(doc) - 1 and path_matches(doc[:-1], route[:len(doc) - 1])
    if len(doc) != len(route):
        return False
    for d, r in zip(doc, route, strict=True):
        param = re.fullmatch(r"\{.+\}|<.+>", d)
        if not (re.fullmatch(r"\{.+\}", r) or (d == r and not param)):
            return False
    return True


@cache
def settings_names() -> set[str]:
    """Every service setting (a field of a ServiceSettings class) and every variable the code reads itself."""
    import pkgutil

    from shared.platform.settings import ServiceSettings

    for service in pkgutil.iter_modules([str(REPO / "services")]):
        if (REPO / "services" / service.name / "settings.py").exists():
            importlib.import_module(f"services.{service.name}.settings")
    classes, todo = set(), [ServiceSettings]
    while todo:
        cls = todo.pop()
        classes.add(cls)
        todo += cls.__subclasses__()
    fields = {name.upper() for cls in classes for name in cls.model_fields}
    sources = "\n".join(p.read_text() for d in ("services", "shared") for p in (REPO / d).rglob("*.py"))
    read = set(re.findall(r"(?:environ\.get|environ\[|getenv)\(?\s*[\"']([A-Z][A-Z0-9_]+)[\"']", sources))
    return fields | read


def problems(doc: Path) -> list[str]:
    """What in `doc` names something that does not exist; empty when everything does."""
    text = doc.read_text()
    out = []
    for link in links(text):
        file, _, anchor = link.partition("#")
        target = (doc.parent / file).resolve() if file else doc
        if not target.exists():
            out.append(f"link {link}: no file {target}")
        elif anchor and target.suffix == ".md" and anchor not in slugs(target.read_text()):
            out.append(f"link {link}: no heading #{anchor} in {target.name}")
    out += [f"make {t}: no such Makefile target" for t in sorted(make_targets(text) - makefile_targets())]
    out += [f"python -m {m}: no such module" for m in sorted(python_modules(text)) if not module_exists(m)]
    out += [f"flywheel {' '.join(c)}: no such CLI command" for c in sorted(cli_commands(text)) if not cli_has(c)]
    out += [f"{m} {p}: no such route" for m, p in sorted(rest_routes(text)) if not route_served(m, p)]
    if doc.name == "configuration.md":
        out += [f"{v}: no such setting" for v in sorted(config_variables(text) - settings_names())]
    return out


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def cli_has(words: tuple[str, ...]) -> bool:
    command = cli()
    for word in words:
        subcommands = getattr(command, "commands", None)  # a group's (typer vendors its own click classes)
        if subcommands is None:
            return True  # the rest are the command's arguments
        command = subcommands.get(word)
        if command is None:
            return False
    return True


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(REPO).as_posix())
def test_everything_the_doc_names_exists(doc):
    assert problems(doc) == []


def test_the_readme_is_short_and_links_every_doc():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README is the front page: move the long story into docs/"
    linked = {(REPO / link.partition("#")[0]).resolve() for link in links(readme)}
    assert set(DOCS[1:]) <= linked, f"docs the README does not link: {sorted(set(DOCS[1:]) - linked)}"


def test_the_checker_sees_what_the_docs_name():
    """Each kind of check finds its things in the docs, so an extraction that broke cannot pass silently."""
    texts = [d.read_text() for d in DOCS]
    assert sum(len(links(t)) for t in texts) >= 20
    assert {"up", "test", "demo", "chaos", "k8s-validate"} <= set().union(*map(make_targets, texts))
    assert {"tests.support.tiny_model", "tests.support.grading", "services.trainer.main"} <= set().union(*map(python_modules, texts))
    assert {("runs", "start"), ("runs", "pause"), ("datasets", "import"), ("sql",)} <= set().union(
        *map(cli_commands, texts))
    routes = set().union(*map(rest_routes, texts))
    assert {("POST", "/v1/runs"), ("GET", "/v1/relay/<run>/<v>/<file>"), ("POST", "/v1/chat/completions")} <= routes
    assert {"REDIS_URL", "ROLLOUT_CAPACITY", "TRACKING_MLFLOW_EXPERIMENT"} <= config_variables(
        (REPO / "docs/configuration.md").read_text())


def test_the_checker_fails_on_what_does_not_exist(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A heading\n")
    good = tmp_path / "good.md"
    good.write_text("# Good\n\n[a](other.md#a-heading) [b](#good) [c](https://example.com/x)\n\n"
                    "```bash\nmake up\npython -m tests.support.tiny_model x\nflywheel runs show r\n```\n\n"
                    "`GET /v1/runs/{id}`, `POST /v1/runs/<run>/pause|resume`, `/v1/datasets/import`, "
                    "`PUT /v1/runs/{run_id}/versions/{version}/files/{name}`, `DELETE /v1/datasets/...`\n")
    assert problems(good) == []
    bad = tmp_path / "bad.md"
    bad.write_text("# Bad\n\n[a](missing.md) [b](other.md#no-heading) [c](#nowhere)\n\n"
                   "```bash\nmake no-such-target\npython -m no_such_pkg.mod\nflywheel runs nosuch r\n"
                   "torchrun --nproc-per-node=2 -m services.no_such_main\n"
                   "flywheel nosuch\n```\n\n`GET /v1/nosuch`, `DELETE /v1/runs/{id}`, `POST /v1/runs/{id}/pause|explode`\n")
    found = problems(bad)
    for expected in ("link missing.md", "link other.md#no-heading", "link #nowhere", "make no-such-target",
                     "python -m no_such_pkg.mod", "python -m services.no_such_main", "flywheel runs nosuch", "flywheel nosuch", "GET /v1/nosuch",
                     "DELETE /v1/runs/{id}", "POST /v1/runs/{id}/pause|explode"):
        assert any(p.startswith(expected) for p in found), (expected, found)
    assert len(found) == 11, found
    config = tmp_path / "configuration.md"
    config.write_text("| variable | default |\n|---|---|\n| `REDIS_URL` / `NO_SUCH_SETTING` | x |\n")
    assert problems(config) == ["NO_SUCH_SETTING: no such setting"]
