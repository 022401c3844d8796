"""The JSON schema of every stream message equals the checked-in snapshot, so changing a contract is a
deliberate act: add optional fields freely, bump the type's SCHEMA_VERSION for a breaking change, then

    UPDATE_SNAPSHOTS=1 pytest -q tests/contract/test_schema_snapshot.py

and commit tests/contract/message_schemas.json with the change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shared.contracts.messages import MESSAGE_TYPES

SNAPSHOT = Path(__file__).with_name("message_schemas.json")


def current_schemas() -> dict:
    return {
        name: {"schema_version": cls.SCHEMA_VERSION, "schema": cls.model_json_schema()}
        for name, cls in sorted(MESSAGE_TYPES.items())
    }


def test_message_schemas_match_snapshot():
    current = current_schemas()
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    assert SNAPSHOT.exists(), f"no snapshot at {SNAPSHOT}; create it with UPDATE_SNAPSHOTS=1"
    snapshot = json.loads(SNAPSHOT.read_text())
    assert sorted(current) == sorted(snapshot), "message types added or removed; see this file's docstring"
    changed = [name for name in current if current[name] != snapshot[name]]
    assert not changed, f"message schemas changed: {changed}; if deliberate, see this file's docstring"


def shape(node):
    """A schema without its documentation: what decoding depends on."""
    if isinstance(node, dict):
        return {k: shape(v) for k, v in node.items() if k not in ("title", "description", "examples")}
    if isinstance(node, list):
        return [shape(v) for v in node]
    return node


def objects(schema: dict) -> dict[str, dict]:
    """The message's own object schema and each nested model's ($defs), by name."""
    return {"<root>": schema, **schema.get("$defs", {})}


def breaking_changes(old: dict, new: dict) -> list[str]:
    found = []
    for obj, before in objects(old).items():
        after = objects(new).get(obj, {})
        old_props, new_props = before.get("properties", {}), after.get("properties", {})
        found += [f"{obj}.{f} removed" for f in sorted(set(old_props) - set(new_props))]
        found += [f"{obj}.{f} retyped" for f in sorted(set(old_props) & set(new_props))
                  if shape(old_props[f]) != shape(new_props[f])]
        newly_required = set(after.get("required", [])) - set(before.get("required", []))
        found += [f"{obj}.{f} now required" for f in sorted(newly_required)]
    return found


def test_a_breaking_change_bumps_the_version():
    """Removing, retyping or requiring a field (not adding an optional one) needs a new SCHEMA_VERSION."""
    snapshot = json.loads(SNAPSHOT.read_text())
    for name, now in current_schemas().items():
        old = snapshot.get(name)
        if old is None or old["schema_version"] != now["schema_version"]:
            continue
        broken = breaking_changes(old["schema"], now["schema"])
        assert not broken, f"{name}: {broken} without bumping SCHEMA_VERSION ({now['schema_version']})"


def test_breaking_change_detector_sees_a_removed_and_a_retyped_field():
    old = {"properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
    new = {"properties": {"a": {"type": "string", "title": "A"}, "c": {"type": "string"}}, "required": ["a", "c"]}
    assert breaking_changes(old, new) == ["<root>.b removed", "<root>.a retyped", "<root>.c now required"]
    assert breaking_changes(old, {**old, "properties": {**old["properties"], "d": {"type": "string"}}}) == []
