"""Every table has one writing owner (shared/contracts/db/owners.py), read off the code: a service that writes a table it
does not own (SQLAlchemy insert/update/delete/`session.add` of its model, an attribute set on a row it loaded,
or INSERT/UPDATE/DELETE/COPY in SQL text), itself or through a `shared/` function it imports, fails here. Readers
are checked the same way, and the "Who owns what" table of docs/architecture.md shows the map.

    pytest -q tests/contract/test_table_owners.py
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from shared.contracts.db import models
from shared.contracts.db.owners import OWNERS, SERVICES

REPO = Path(__file__).resolve().parents[2]
TABLES = {c.__tablename__: c.__name__ for c in vars(models).values()
          if isinstance(c, type) and "__tablename__" in vars(c)}
MODEL_TABLE = {cls: table for table, cls in TABLES.items()}
WRITE_SQL = re.compile(r"\b(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM|COPY)\s+([a-z_]+)\b", re.I)
READ_SQL = re.compile(r"\b(?:FROM|JOIN)\s+([a-z_]+)\b", re.I)
DYNAMIC_WRITE_SQL = re.compile(r"\b(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM|COPY)\s+\{\}", re.I)
DYNAMIC_READ_SQL = re.compile(r"\b(?:FROM|JOIN)\s+\{\}", re.I)
WRITE_CALLS = {"insert", "update", "delete", "pg_insert"}


def _text(node: ast.AST) -> str | None:
    """A string literal, or an f-string with its holes as `{}`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


@dataclass
class Access:
    """What one top-level function, class or constant of a file does with tables. `dynamic`: it writes (or
    reads) a table whose name is a placeholder in SQL text (`INSERT INTO {}`); which one is resolved by
    `resolve`."""
    writes: set[str] = field(default_factory=set)
    reads: set[str] = field(default_factory=set)
    named: set[str] = field(default_factory=set)  # table names spelled out as string literals
    dynamic_writes: bool = False
    dynamic_reads: bool = False


def _loaded_rows(top: ast.AST) -> dict[str, str]:
    """{variable: table} for the variables bound to rows of one model (`c = s.get(Checkpoint, k)`, `for c in
    s.execute(select(Checkpoint)...).scalars()`, and the names bound from those): setting an attribute of one (`c.status = "deleted"`), which the
    session then flushes, writes that table."""
    bound: dict[str, str] = {}
    for node in ast.walk(top):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets, value = (node.targets if isinstance(node, ast.Assign) else [node.target]), node.value
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            targets, value = [node.target], node.iter
        else:
            continue
        table = _rows_of(value, bound) if value is not None else None
        if table:
            bound.update({t.id: table for t in targets if isinstance(t, ast.Name)})
    return bound


def _rows_of(value: ast.AST, bound: dict[str, str]) -> str | None:
    """The table whose rows `value` gives: `select(M)` or `get(M, ...)` inside it, or a variable bound so."""
    if isinstance(value, ast.Name):
        return bound.get(value.id)
    for sub in ast.walk(value):
        if isinstance(sub, ast.Call) and _name(sub.func) in {"select", "get", "query"} and sub.args \
                and _name(sub.args[0]) in MODEL_TABLE and isinstance(sub.args[0], ast.Name):
            return MODEL_TABLE[sub.args[0].id]
    return None


def scan_file(path: Path) -> dict[str, Access]:
    """{top-level function, class or assigned name ('' for the rest of the module level): its Access}."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: dict[str, Access] = defaultdict(Access)
    for top in tree.body:
        owner = top.name if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) else \
            top.targets[0].id if isinstance(top, ast.Assign) and isinstance(top.targets[0], ast.Name) else ""
        acc = found[owner]
        rows = _loaded_rows(top)
        for node in ast.walk(top):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del) \
                    and isinstance(node.value, ast.Name) and node.value.id in rows:
                acc.writes.add(rows[node.value.id])
            if isinstance(node, ast.Call) and _name(node.func) in {"delete", "merge"} and node.args \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in rows:
                acc.writes.add(rows[node.args[0].id])
            if isinstance(node, ast.Call):
                fn = _name(node.func)
                if fn in WRITE_CALLS and node.args and _name(node.args[0]) in MODEL_TABLE:
                    acc.writes.add(MODEL_TABLE[_name(node.args[0])])
                if fn in MODEL_TABLE:  # a model instance is made to be added to a session
                    acc.writes.add(MODEL_TABLE[fn])
            if (name := _name(node)) in MODEL_TABLE:
                acc.reads.add(MODEL_TABLE[name])
                acc.named.add(MODEL_TABLE[name])
            if (text := _text(node)) is not None:
                if text in TABLES:
                    acc.named.add(text)
                for m in WRITE_SQL.finditer(text):
                    if m.group(1) in TABLES:
                        acc.writes.add(m.group(1))
                acc.dynamic_writes |= bool(DYNAMIC_WRITE_SQL.search(text))
                acc.dynamic_reads |= bool(DYNAMIC_READ_SQL.search(text))
                acc.reads |= {m.group(1) for m in READ_SQL.finditer(text) if m.group(1) in TABLES}
    return found


def resolve(acc: Access, tables: set[str]) -> tuple[set[str], set[str]]:
    """(writes, reads) of `acc`, its placeholder tables taken to be `tables`."""
    return acc.writes | (tables if acc.dynamic_writes else set()), acc.reads | (tables if acc.dynamic_reads else set())


def _imported(tree: ast.Module) -> set[tuple[str, str]]:
    """(shared module, name) pairs a file uses: `from shared.m import f` gives (m, f); `from shared import m`
    or `import shared.m` then `m.f(...)` gives (m, f)."""
    used, modules = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shared"):
            for a in node.names:
                if node.module == "shared":
                    modules[a.asname or a.name] = a.name
                else:
                    used.add((node.module.removeprefix("shared.").replace(".", "/"), a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("shared."):
                    modules[a.asname or a.name] = a.name.removeprefix("shared.").replace(".", "/")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            used.add((modules[node.value.id], node.attr))
    return used


def table_access(root: Path) -> tuple[dict[str, dict[str, set[str]]], dict[str, dict[str, set[str]]]]:
    """({table: {service: files}} written, the same read), each service folder under `root`/services counted
    with the `shared/` functions and classes it imports."""
    shared = {str(p.relative_to(root / "shared").with_suffix("")): scan_file(p)
              for p in (root / "shared").rglob("*.py")}
    written: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    read: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in sorted((root / "services").rglob("*.py")):
        service = path.relative_to(root / "services").parts[0]
        where = str(path.relative_to(root))
        own = scan_file(path)
        file_named = set().union(*(a.named for a in own.values()))
        parts = [(where, resolve(acc, file_named)) for acc in own.values()]
        used = [(module, name) for module, name in _imported(ast.parse(path.read_text()))
                if name in shared.get(module, {})]
        for module, name in used:
            # A shared function writing a placeholder table writes the tables named by the constants of its
            # module that this file uses with it (leases.acquire with leases.TRAINER), else every table its
            # module names.
            chosen = set().union(*(shared[module][n].named for m, n in used if m == module and n != name))
            tables = chosen or set().union(*(a.named for a in shared[module].values()))
            parts.append((f"{where} (via shared/{module}.py {name})", resolve(shared[module][name], tables)))
        for at, (writes, reads) in parts:
            for t in writes:
                written[t][service].add(at)
            for t in reads:
                read[t][service].add(at)
    return written, read


def test_every_table_has_an_entry():
    assert set(OWNERS) == set(TABLES), f"tables without an owner: {sorted(set(TABLES) - set(OWNERS))}; " \
        f"entries for no table: {sorted(set(OWNERS) - set(TABLES))}"
    for table, o in OWNERS.items():
        assert {o.owner, *o.readers} <= SERVICES, table


def test_only_the_owner_writes_a_table():
    written, _ = table_access(REPO)
    stray = {(t, s): sorted(files) for t, by in written.items() for s, files in by.items()
             if s != OWNERS[t].owner}
    assert stray == {}, "services writing tables they do not own (shared/contracts/db/owners.py): send the owner a " \
        f"message instead: {stray}"


def test_readers_are_declared():
    _, read = table_access(REPO)
    undeclared = {(t, s): sorted(files)[:3] for t, by in read.items() for s, files in by.items()
                  if s not in {OWNERS[t].owner, *OWNERS[t].readers}}
    assert undeclared == {}, f"services reading tables the map does not list them for: {undeclared}"
    stale = {(t, s) for t, o in OWNERS.items() for s in o.readers if s not in read.get(t, {})}
    assert stale == set(), f"{sorted(stale)} no longer read these tables: delete them from the map's readers"


def test_the_architecture_doc_table_shows_the_map():
    doc = (REPO / "docs/architecture.md").read_text()
    section = doc.split("## Who owns what", 1)[1].split("\n#", 1)[0]
    rows = {cells[0].strip("` "): cells for line in section.splitlines() if line.startswith("| `")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    assert set(rows) == set(OWNERS)
    for table, o in OWNERS.items():
        assert rows[table][1:4] == [o.owner, ", ".join(o.readers) or "-", o.changed_by], table


def test_the_scan_sees_every_spelling(tmp_path):
    (tmp_path / "services/a").mkdir(parents=True)
    (tmp_path / "services/b").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared/lib.py").write_text(
        "def touch(c):\n    c.execute('UPDATE runs SET status = 1')\n\n"
        "def look(c):\n    return c.execute('SELECT 1 FROM checkpoints')\n")
    (tmp_path / "shared/slots.py").write_text(  # one function, the table chosen by a constant of its module
        "A = 'metrics'\nB = 'train_samples'\n\ndef put(c, table):\n    c.execute(f'DELETE FROM {table} WHERE 1')\n")
    (tmp_path / "services/c").mkdir()
    (tmp_path / "services/c/w.py").write_text("from shared import slots\n\ndef k(c):\n    slots.put(c, slots.B)\n")
    (tmp_path / "services/c/v.py").write_text("from shared.slots import put\n\ndef j(c, t):\n    put(c, t)\n")
    (tmp_path / "services/a/x.py").write_text(
        "from sqlalchemy import insert\nfrom shared.contracts.db.models import Run, Metric\n\n"
        "def f(s, c):\n    c.execute(insert(Run).values())\n    m = Metric(name='x')\n    s.add(m)\n")
    (tmp_path / "services/a/y.py").write_text(
        "def g(cur, table):\n    cur.execute(f'INSERT INTO {table} SELECT 1')\n\nROWS = {'episodes': []}\n")
    (tmp_path / "services/b/rows.py").write_text(  # rows loaded, then changed or deleted through the session
        "from sqlalchemy import select\nfrom shared.contracts.db.models import Checkpoint, Job, Run\n\n"
        "def gc(s, done):\n    old = s.execute(select(Checkpoint).where(Checkpoint.run_id.in_(done))).scalars()\n"
        "    for c in old:\n        c.status = 'deleted'\n    s.delete(s.get(Job, 1))\n    j = s.get(Job, 2)\n"
        "    s.delete(j)\n    r = s.get(Run, 3)\n    print(r.status)\n")
    (tmp_path / "services/b/z.py").write_text(
        "from shared import lib\nfrom shared.lib import look\n\ndef h(c):\n    lib.touch(c)\n    look(c)\n"
        "    c.execute('DELETE FROM jobs WHERE 1')\n")
    written, read = table_access(tmp_path)
    assert {t: set(by) for t, by in written.items()} == {
        "runs": {"a", "b"}, "metrics": {"a", "c"}, "episodes": {"a"}, "jobs": {"b"}, "train_samples": {"c"},
        "checkpoints": {"b"}}
    assert written["jobs"]["b"] == {"services/b/z.py", "services/b/rows.py"}  # `s.delete(j)` of a loaded row
    assert "services/b/rows.py" not in written["runs"]["b"]  # a row only read is no write
    assert written["metrics"]["c"] == {"services/c/v.py (via shared/slots.py put)"}  # no constant: every table
    assert set(read["checkpoints"]) == {"b"}
