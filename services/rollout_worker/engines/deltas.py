"""Weight deltas for engines backed by vLLM with `FlywheelWorkerExtension` (in-process `vllm`, and `openai`
against a vLLM server): the bookkeeping both share, without importing vLLM.

The engine's side keeps the served version's tensors on CPU (checkpoint names and dtype: one more copy of the
weights in host memory, read from the served checkpoint folder when the first delta after it comes), applies
the delta to them (each changed tensor checked against the manifest's digest before vLLM sees it), and hands
vLLM only the changed tensors with the other tensors of each vLLM layer they belong to (vLLM rebuilds a layer
from all its tensors: a fused qkv_proj from q, k and v together), in one safetensors file that the worker
extension's `flywheel_load_tensors(path)` loads. Each engine supplies how it reaches the extension.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from shared.weights.delta import read_safetensors
from shared.weights.manifest import ChecksumError

if TYPE_CHECKING:
    import torch

    from shared.weights.delta import WeightUpdate


class ServedTensors:
    """The tensors an engine serves, and the file a delta to them is loaded from.

        served = ServedTensors(model_path, scratch_dir)
        served.reloaded(folder)                       # after a full reload succeeded
        n = await served.apply(update, packed, load)  # packed(): the extension's flywheel_packed_modules;
                                                      # load(path): flywheel_load_tensors with generation paused
    """

    def __init__(self, folder: str | Path, scratch_dir: str | Path | None = None):
        self._folder = Path(folder)  # the served checkpoint, read when the first delta on it comes
        self._tensors: dict[str, torch.Tensor] | None = None
        self._packed: dict[str, list[str]] | None = None  # vLLM's fused layers: {"qkv_proj": ["q_proj", ...]}
        # The file must be readable by vLLM's workers: same machine (/dev/shm) or a directory shared with them.
        self.scratch_dir = Path(scratch_dir) if scratch_dir else Path("/dev/shm") if os.path.isdir("/dev/shm") else None

    def reloaded(self, folder: str | Path) -> None:
        """The engine now serves the full checkpoint in `folder`."""
        self._folder, self._tensors = Path(folder), None

    async def apply(self, update: WeightUpdate, packed: Callable[[], Awaitable[dict[str, list[str]]]],
                    load: Callable[[str], Awaitable[None]]) -> int:
        """Apply `update` to the served tensors and `load` the file of what vLLM must rebuild; the number of
        tensors loaded. ChecksumError (before `load`): the served tensors are unknown or are not the update's
        base; nothing changed. An error from `load` leaves the served tensors at the base."""
        if self._tensors is None:
            if not any(self._folder.glob("*.safetensors")):
                raise ChecksumError(f"no tensors of v{update.base.version} to apply delta v{update.version} to")
            self._tensors = await asyncio.to_thread(read_safetensors, self._folder)
        new = await asyncio.to_thread(update.apply, self._tensors)  # ChecksumError: nothing changed
        if self._packed is None:
            self._packed = await packed()
        send = with_layer_mates(self._tensors, new, self._packed)
        if self.scratch_dir is not None:
            self.scratch_dir.mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=".delta-", suffix=".safetensors", dir=self.scratch_dir)
        os.close(fd)
        try:
            await asyncio.to_thread(_save, send, path)
            await load(path)
        finally:
            os.unlink(path)
        self._tensors.update(new)
        return len(send)


def with_layer_mates(current: dict, new: dict, packed: dict[str, list[str]]) -> dict:
    """`new` plus the tensors of `current` that share a vLLM layer with one of them."""
    groups = layer_groups(current, packed)
    touched = {groups[n] for n in new}
    return {n: new.get(n, t) for n, t in current.items() if groups[n] in touched}


def layer_groups(names, packed: dict[str, list[str]]) -> dict[str, str]:
    """Checkpoint tensor name -> the vLLM layer that holds it: its module path, with a part that vLLM fuses
    (packed {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}) named by the fused layer."""
    fused = {part: whole for whole, parts in packed.items() for part in parts}
    out = {}
    for name in names:
        module, _, _ = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        out[name] = f"{parent}.{fused[last]}" if last in fused else module
    return out


def _save(tensors: dict, path: str) -> None:
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in tensors.items()}, path)
