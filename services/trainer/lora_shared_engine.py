"""LoRA runs over one base share one engine: one copy of the base per trainer process (per rank), and per run
its own adapter weights, optimizer state and learning-rate schedule.

    engine = open_engine(run_id, model, algo, **options)   # a PolicyEngine, or a run's view of a shared one
    close_engine(run_id)                                   # the last run out frees the engine

Runs share an engine when the model, the whole algorithm and the engine options are the same. A run's state is
swapped in before each of its calls, one call at a time, so a swap never races a step.

More: docs/lora.md#one-trainer-engine-for-many-runs
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer.engine import PolicyEngine
from shared.platform.logs import get_logger

log = get_logger(__name__)
SWAPPED_IN = ("log_probs", "update", "forward_backward", "optim_step", "save", "load", "export_adapter", "export_hf")  # calls that read a run's state


@dataclass
class _Slot:
    """One run's share of the engine while another run is swapped in."""

    params: list[torch.Tensor]  # the adapter, one tensor per trainable parameter (same placement)
    moments: list[dict]  # the optimizer's state per parameter ({}: none yet)
    schedule: dict | None = None  # the lr scheduler's state_dict (None: the engine's initial one)
    lrs: list[float] | None = None  # each param group's current lr
    grads: list[torch.Tensor | None] | None = None  # gradients accumulated and not yet applied (Tinker's split step)


class SharedLoRABase:
    """One PolicyEngine serving several LoRA runs; `run(run_id)` is a run's PolicyEngine-like view."""

    def __init__(self, engine: PolicyEngine):
        self.engine = engine
        self.params = [p for p in engine.actor.engine.module.parameters() if p.requires_grad]
        self.optimizer = engine.actor.engine.optimizer
        self.scheduler = engine.actor.engine.lr_scheduler
        self.fresh = [p.detach().clone() for p in self.params]  # the adapter as built: every run starts here
        self.fresh_schedule = self.scheduler.state_dict()
        self.fresh_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.slots: dict[str, _Slot] = {}
        self.active: str | None = None

    def run(self, run_id: str) -> SharedBaseView:
        self.slots[run_id] = _Slot([t.clone() for t in self.fresh], [{} for _ in self.params])
        if self.active == run_id:
            self.active = None  # a run opened again starts from its fresh state (then its checkpoint)
        return SharedBaseView(self, run_id)

    def drop(self, run_id: str) -> None:
        self.slots.pop(run_id, None)
        if self.active == run_id:
            self.active = None

    def activate(self, run_id: str) -> None:
        """Swap `run_id`'s adapter, optimizer state and schedule into the engine (the active run's out first)."""
        if self.active == run_id:
            return
        if self.active is not None:
            out = self.slots[self.active]
            with torch.no_grad():
                for saved, p in zip(out.params, self.params, strict=True):
                    saved.copy_(p.detach())
            out.moments = [self.optimizer.state.get(p, {}) for p in self.params]
            out.schedule = self.scheduler.state_dict()
            out.lrs = [g["lr"] for g in self.optimizer.param_groups]
            out.grads = [p.grad for p in self.params]
        slot = self.slots[run_id]
        with torch.no_grad():
            for p, saved in zip(self.params, slot.params, strict=True):
                p.detach().copy_(saved)
        for p, moments, grad in zip(self.params, slot.moments, slot.grads or [None] * len(self.params), strict=True):
            self.optimizer.state[p] = moments
            p.grad = grad  # one run's gradients never reach another's step
        self.scheduler.load_state_dict(slot.schedule or self.fresh_schedule)
        for group, lr in zip(self.optimizer.param_groups, slot.lrs or self.fresh_lrs, strict=True):
            group["lr"] = lr
        self.active = run_id


class SharedBaseView:
    """A run's PolicyEngine on a shared base: every call that reads or changes the run's state swaps it in."""

    def __init__(self, shared: SharedLoRABase, run_id: str):
        self.shared, self.run_id = shared, run_id

    def __getattr__(self, name: str):
        value = getattr(self.shared.engine, name)
        if name not in SWAPPED_IN:
            return value

        def call(*args, **kwargs):
            self.shared.activate(self.run_id)
            return value(*args, **kwargs)

        return call


_SHARED: dict[str, SharedLoRABase] = {}  # sharing key -> the engine
_RUNS: dict[str, tuple[str | None, object]] = {}  # run -> (its sharing key, its engine or view)


def open_engine(run_id: str, model_path: str, algo, seed: int = 0, **options):
    """The engine run `run_id` trains on: a view of the shared engine of its kind of LoRA run (built with the
    first such run), or a PolicyEngine of its own. Built under the run's `seed`: what the model does not load
    (a LoRA adapter's random init) is the same in any trainer process, so a run opened again before its first
    checkpoint, or a twin with that seed, starts where it did."""
    close_engine(run_id)
    if algo.lora is None or algo.adv_estimator == "gae":
        torch.manual_seed(seed)
        engine = PolicyEngine(model_path, algo, **options)
        _RUNS[run_id] = (None, engine)
        return engine
    key = "\n".join((model_path, algo.model_dump_json(), str(seed), repr(sorted(options.items()))))
    if key not in _SHARED:
        torch.manual_seed(seed)
        _SHARED[key] = SharedLoRABase(PolicyEngine(model_path, algo, **options))
    else:
        log.info("run %s shares a LoRA base engine with runs %s", run_id, sorted(_SHARED[key].slots))
    view = _SHARED[key].run(run_id)
    _RUNS[run_id] = (key, view)
    return view


def engine_of(run_id: str):
    """The engine (or shared-engine view) `open_engine` gave run `run_id` in this process."""
    return _RUNS[run_id][1]


def close_engine(run_id: str) -> None:
    """Forget the run's engine state; a shared engine is freed with its last run."""
    key, _ = _RUNS.pop(run_id, (None, None))
    if key is not None and key in _SHARED:
        _SHARED[key].drop(run_id)
        if not _SHARED[key].slots:
            del _SHARED[key]


def engines_held() -> int:
    """Distinct engines (copies of a model) this process holds."""
    return len(_SHARED) + sum(key is None for key, _ in _RUNS.values())
