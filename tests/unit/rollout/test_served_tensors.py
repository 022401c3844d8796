"""engines/deltas.py ServedTensors, the delta bookkeeping the vllm and openai engines share, with the engine's
side (packed modules, loading the file) faked: what is loaded, from which file, and what is kept when the
delta or the load fails. Runs without vLLM."""

from __future__ import annotations

import pytest
import torch
from fixtures.weight_deltas import load_update, write_delta
from safetensors.torch import load_file, save_file

from services.rollout_worker.engines.deltas import ServedTensors
from shared.weights.manifest import ChecksumError, tensor_entries

BASE = {"l.0.attn.q_proj.weight": torch.zeros(2, 2), "l.0.attn.k_proj.weight": torch.ones(2, 2),
        "l.0.mlp.down_proj.weight": torch.full((2, 2), 2.0), "norm.weight": torch.ones(2)}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


@pytest.fixture
def served(tmp_path):
    (tmp_path / "v0").mkdir()
    save_file(BASE, str(tmp_path / "v0" / "model.safetensors"))
    return ServedTensors(tmp_path / "v0", tmp_path / "scratch")


def changed(**values) -> dict:
    return {n: values.get(n.split(".")[-2], t) for n, t in BASE.items()}


class Server:
    """The engine's side: records each file it is asked to load (read at once: the file goes after)."""

    def __init__(self, fail: bool = False):
        self.loaded: list[dict] = []
        self.fail = fail

    async def packed(self) -> dict:
        return PACKED

    async def load(self, path: str) -> None:
        self.loaded.append(load_file(path))
        if self.fail:
            raise RuntimeError("the server could not load it")


async def test_changed_tensors_go_with_their_layer_mates_and_the_next_delta_builds_on_them(served, tmp_path):
    server = Server()
    v1 = changed(q_proj=torch.full((2, 2), 5.0))
    assert await served.apply(load_update(write_delta(tmp_path, 1, BASE, v1)), server.packed, server.load) == 2
    assert server.loaded[0].keys() == {"l.0.attn.q_proj.weight", "l.0.attn.k_proj.weight"}  # one qkv_proj
    assert torch.equal(server.loaded[0]["l.0.attn.q_proj.weight"], v1["l.0.attn.q_proj.weight"])
    v2 = {**v1, "norm.weight": torch.zeros(2)}
    await served.apply(load_update(write_delta(tmp_path, 2, v1, v2)), server.packed, server.load)
    assert list(server.loaded[1]) == ["norm.weight"]
    assert list((tmp_path / "scratch").iterdir()) == []  # each file deleted once loaded


async def test_a_failed_check_or_load_keeps_the_base(served, tmp_path):
    v1 = changed(down_proj=torch.zeros(2, 2))

    def update(attempt: str, **kwargs):
        (tmp_path / attempt).mkdir()
        return load_update(write_delta(tmp_path / attempt, 1, BASE, v1, **kwargs))

    server = Server()
    with pytest.raises(ChecksumError):  # the manifest claims down_proj keeps its base value
        await served.apply(update("claims-base", tensors=tensor_entries(BASE)), server.packed, server.load)
    assert server.loaded == []  # refused before the engine saw anything
    failing = Server(fail=True)
    with pytest.raises(RuntimeError):
        await served.apply(update("load-fails"), failing.packed, failing.load)
    assert list((tmp_path / "scratch").iterdir()) == []
    await served.apply(update("again"), server.packed, server.load)  # the served tensors are still v0's
    assert torch.equal(server.loaded[0]["l.0.mlp.down_proj.weight"], torch.zeros(2, 2))


async def test_without_the_served_checkpoint_a_delta_is_refused(served, tmp_path):
    served.reloaded(tmp_path / "gone")  # e.g. the checkpoint cache dropped it
    server = Server()
    with pytest.raises(ChecksumError, match="no tensors"):
        await served.apply(load_update(write_delta(tmp_path, 1, BASE, changed(q_proj=torch.ones(2, 2)))),
                           server.packed, server.load)
    assert server.loaded == []
