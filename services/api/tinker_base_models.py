"""The base models the Tinker protocol offers: TINKER_BASE_MODELS (comma-separated local paths or hub ids, each
offered under the name as written) or, unset, every model folder (one with a config.json) under
DATA_DIR/models, offered under its folder name. A local folder's config.json gives the architecture and the
context length; a hub id is offered as is, without either."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


@dataclass(frozen=True)
class OfferedModel:
    name: str  # what a client passes as `base_model`
    source: str  # the folder or hub id a worker loads (also the tokenizer id the SDK is given)
    arch: str | None = None
    max_context_length: int | None = None


def _described(name: str, source: str) -> OfferedModel:
    config_file = Path(source) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return OfferedModel(name, source)
    arch = (config.get("architectures") or [None])[0]
    context = next((config[k] for k in CONTEXT_KEYS if isinstance(config.get(k), int)), None)
    return OfferedModel(name, str(Path(source).resolve()), arch, context)


def base_models(setting: str | None, data_dir: Path) -> dict[str, OfferedModel]:
    """{name: model}, in the order offered."""
    if setting is not None and setting.strip():
        entries = [e.strip() for e in setting.split(",") if e.strip()]
        return {e: _described(e, e) for e in entries}
    root = Path(data_dir) / "models"
    folders = sorted(p for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []
    return {p.name: _described(p.name, str(p)) for p in folders}
