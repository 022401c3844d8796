"""The base models the Tinker API offers: TINKER_BASE_MODELS as written, else the model folders of DATA_DIR/models.

    pytest -q tests/unit/api/test_tinker_base_models.py
"""

from __future__ import annotations

import json

from services.api.tinker_base_models import base_models


def model_folder(path, **config):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_default_is_every_model_folder_under_data_dir_models(tmp_path):
    model_folder(tmp_path / "models" / "b-model", architectures=["Qwen2ForCausalLM"], max_position_embeddings=4096)
    model_folder(tmp_path / "models" / "a-model", n_positions=1024)
    (tmp_path / "models" / "empty").mkdir()
    (tmp_path / "models" / "notes.txt").write_text("not a model")
    offered = base_models(None, tmp_path)
    assert list(offered) == ["a-model", "b-model"]
    assert (offered["b-model"].arch, offered["b-model"].max_context_length) == ("Qwen2ForCausalLM", 4096)
    assert offered["a-model"].max_context_length == 1024 and offered["a-model"].arch is None
    assert offered["a-model"].source == str((tmp_path / "models" / "a-model").resolve())


def test_no_models_folder_offers_nothing(tmp_path):
    assert base_models(None, tmp_path) == {} and base_models("  ", tmp_path) == {}


def test_the_setting_names_paths_and_hub_ids_as_written(tmp_path):
    local = model_folder(tmp_path / "mine", max_position_embeddings=2048)
    model_folder(tmp_path / "models" / "ignored")
    offered = base_models(f"Qwen/Qwen3-8B, {local}", tmp_path)
    assert list(offered) == ["Qwen/Qwen3-8B", str(local)]
    assert offered["Qwen/Qwen3-8B"].source == "Qwen/Qwen3-8B" and offered["Qwen/Qwen3-8B"].max_context_length is None
    assert offered[str(local)].max_context_length == 2048
