"""What a run dispatches, as a deterministic function of its config and dataset (so a restarted controller
recomputes the same plan and diffs it against the ledger).

A slot is one (task, sample) of the plan; sample_idx is unique within the run (epoch * slots_per_task + s).
The dispatch window counts groups (one task's slots in one batch), the unit the trainer consumes: groups [0,
group_limit) may be dispatched, group_limit staying (max_staleness + 1) batches of groups ahead of what the
trainer consumed. Batches past num_batches continue the epochs to replace dropped groups.

More: docs/architecture.md#dispatch
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache

from shared.contracts.run_config import RunConfig


@dataclass(frozen=True)
class Slot:
    task_id: str
    sample_idx: int
    batch_idx: int
    epoch: int
    greedy: bool

    @property
    def key(self) -> tuple[str, int]:
        return (self.task_id, self.sample_idx)


class Plan:
    def __init__(self, cfg: RunConfig, task_ids: list[str]):
        if not task_ids:
            raise ValueError(f"dataset {cfg.dataset!r} split {cfg.dataset_split!r} has no rows to dispatch")
        self.cfg, self.task_ids = cfg, task_ids
        self.is_eval = cfg.kind == "eval"
        self.greedy = not self.is_eval and cfg.algorithm.adv_estimator == "remax"
        self.slots_per_task = cfg.samples_per_task + int(self.greedy)
        self.batches_per_epoch = 1 if self.is_eval else math.ceil(len(task_ids) / cfg.tasks_per_batch)
        self.num_batches = 1 if self.is_eval else (cfg.total_steps or cfg.epochs * self.batches_per_epoch)
        self.batch = lru_cache(maxsize=64)(self._batch)
        self._epoch_order = lru_cache(maxsize=2)(self._epoch_order)

    @property
    def planned_steps(self) -> int:
        """Optimizer steps after which a training run is complete (one policy version per batch)."""
        return self.num_batches

    def group_limit(self, policy_version: int, dropped_groups: int = 0) -> int:
        """Groups [0, group_limit) may be dispatched now (eval: all of them)."""
        if self.is_eval:
            return len(self.task_ids)
        steps = min(policy_version + self.cfg.max_staleness + 1, self.planned_steps)
        return steps * self.cfg.tasks_per_batch + dropped_groups

    def first_window_slots(self) -> int:
        """Slots the run may dispatch before the trainer steps once (eval: all of them): its first attempts."""
        if self.is_eval:
            return len(self.task_ids) * self.cfg.samples_per_task
        return self.group_limit(0) * self.slots_per_task

    def group_index(self, b: int, i: int) -> int:
        """Position in dispatch order of the group holding slot i of batch b (epochs need not split evenly)."""
        epoch, j = divmod(b, self.batches_per_epoch)
        return epoch * len(self.task_ids) + j * self.cfg.tasks_per_batch + i // self.slots_per_task

    def _batch(self, b: int) -> list[Slot]:
        if self.is_eval:
            return [Slot(t, s, 0, 0, False) for t in self.task_ids for s in range(self.cfg.samples_per_task)]
        epoch, i = divmod(b, self.batches_per_epoch)
        tpb = self.cfg.tasks_per_batch
        chosen = self._epoch_order(epoch)[i * tpb:(i + 1) * tpb]
        base = epoch * self.slots_per_task
        return [
            Slot(self.task_ids[t], base + s, b, epoch, s == self.cfg.samples_per_task)
            for t in chosen for s in range(self.slots_per_task)
        ]

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.task_ids)))
        random.Random(f"{self.cfg.seed}:{epoch}").shuffle(order)
        return order
