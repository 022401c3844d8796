"""Data parallelism under torchrun (`torchrun --nproc_per_node=N -m services.trainer.main`).

Rank 0 runs the service and wraps each PolicyEngine in a `ShardedEngine`: every engine call is broadcast to
all ranks (the method and the full batch), each rank runs it on its contiguous slice of rows (verl's FSDP
collectives need every rank in every forward and backward), and per-row results are gathered back in order.
Ranks > 0 run `follow()` instead of the service: they build the same engines and execute the calls until
rank 0 tells them to stop. Batches must split evenly: rows (tasks_per_batch x samples_per_task) % N == 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from services.trainer.lora_shared_engine import close_engine, engine_of, open_engine

ROW_METHODS = ("log_probs", "values")  # results with one row per sample: gathered across ranks


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def shard(x: Any, rank: int, size: int) -> Any:
    """This rank's contiguous slice of every per-row tensor/array in `x` (dicts, lists and tuples walked)."""
    if isinstance(x, dict):
        return {k: shard(v, rank, size) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(shard(v, rank, size) for v in x)
    if isinstance(x, torch.Tensor | np.ndarray) and x.ndim > 0:
        rows = x.shape[0]
        if rows % size:
            raise ValueError(f"a batch of {rows} rows does not split over {size} ranks: make "
                             "tasks_per_batch x samples_per_task a multiple of the number of trainer ranks")
        chunk = rows // size
        return x[rank * chunk:(rank + 1) * chunk]
    return x


class ShardedEngine:
    """Rank 0's handle on an engine that lives on every rank. Attributes come from the local engine."""

    def __init__(self, key: str, *args, **kwargs):
        self.key = key
        _broadcast(("new", key, args, kwargs))
        self.local = open_engine(key, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.local, name)

    def _call(self, method: str, *args, **kwargs):
        _broadcast(("call", self.key, method, args, kwargs))
        return _execute(self.key, method, args, kwargs)

    def log_probs(self, t: dict, *, reference: bool = False):
        return self._call("log_probs", t, reference=reference)

    def values(self, t: dict):
        return self._call("values", t)

    def update(self, *args, **kwargs):
        return self._call("update", *args, **kwargs)

    def update_critic(self, *args, **kwargs):
        return self._call("update_critic", *args, **kwargs)

    def save(self, folder, step: int) -> None:
        self._call("save", folder, step)

    def load(self, folder) -> None:
        self._call("load", folder)

    def export_hf(self, folder, dtype: str = "auto", *, weights: bool = True, device: str = "cpu") -> dict | None:
        return self._call("export_hf", folder, dtype, weights=weights, device=device)

    def export_adapter(self, folder, dtype: str = "auto") -> dict | None:
        return self._call("export_adapter", folder, dtype)


def open_run_engine(run_id: str, *args, **kwargs):
    """Run `run_id`'s engine: on every rank under torchrun, else in this process (either way LoRA runs of one
    kind share one engine, services/trainer/lora_shared_engine.py)."""
    if world_size() > 1:
        return ShardedEngine(run_id, *args, **kwargs)
    return open_engine(run_id, *args, **kwargs)


def close_run_engine(run_id: str) -> None:
    """Free run `run_id`'s engine on every rank (a shared LoRA base goes with its last run)."""
    _broadcast(("drop", run_id))
    close_engine(run_id)


def _execute(key: str, method: str, args: tuple, kwargs: dict):
    rank, size = dist.get_rank(), dist.get_world_size()
    out = getattr(engine_of(key), method)(*shard(args, rank, size), **shard(kwargs, rank, size))
    if method in ROW_METHODS:
        out = _gather_rows(out, size)
    dist.barrier()  # e.g. every rank's checkpoint shard is written before rank 0 marks the step complete
    return out


def _gather_rows(out, size: int):
    parts: list = [None] * size
    dist.all_gather_object(parts, out)
    if isinstance(out, tuple):
        return tuple(torch.cat([p[i] for p in parts]) for i in range(len(out)))
    return torch.cat(parts)


def _broadcast(msg: tuple) -> None:
    if world_size() > 1:
        dist.broadcast_object_list([msg], src=0)


def follow() -> None:
    """Ranks > 0: mirror rank 0's engine calls until it stops. SIGTERM/SIGINT are ignored here: rank 0 gets
    them too and finishes its step (collectives included) before telling the followers to stop."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        op, *rest = box[0]
        if op == "stop":
            return
        if op == "new":
            key, args, kwargs = rest
            open_engine(key, *args, **kwargs)
        elif op == "drop":
            close_engine(rest[0])
        else:
            _execute(*rest)


def stop_followers() -> None:
    _broadcast(("stop",))
