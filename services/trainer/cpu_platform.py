"""A CPU platform for verl, registered through verl's platform registry and selected with VERL_PLATFORM=cpu.

verl 0.9.1 knows only CUDA/NPU/ROCm and otherwise falls back to CUDA calls. This platform answers verl's
device questions for CPU (gloo collectives, no-op profiling, zero memory figures) and registers verl's FSDP
engines for the `cpu` device, so `TrainingWorker` runs its real FSDP2 training step on CPU. Importing this
module has those effects (it is a verl plugin); call `use_cpu_platform()` before anything asks verl for the
platform.
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform


def _zero(*_a, **_k) -> int:
    return 0


# torch.cpu lacks the memory statistics verl logs after each step; report zero instead of crashing.
_CPU_MODULE = types.SimpleNamespace(**{n: getattr(torch.cpu, n) for n in dir(torch.cpu) if not n.startswith("__")})
_CPU_MODULE.__dict__.update(
    max_memory_allocated=_zero, max_memory_reserved=_zero, memory_allocated=_zero, memory_reserved=_zero,
    reset_peak_memory_stats=lambda *a, **k: None, empty_cache=lambda: None, mem_get_info=lambda *a: (0, 0),
    manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, set_device=lambda *a: None,
    current_device=lambda: "cpu", get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state, get_device_name=lambda *a: "CPU", device_count=lambda: 1, is_available=lambda: True,
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CPU_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:  # type: ignore[override]
        # verl passes this straight to `.to(...)`; an int would mean "accelerator 0", which CPU has not.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _register_cpu_engines() -> None:
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, cls in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        if "cpu" not in EngineRegistry._engines.get(model_type, {}).get("fsdp2", {}):
            EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(cls)


def _load_value_model_sdpa(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's value-model loader hard-codes flash-attention, which CPU has not: the same load with sdpa."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        local_path, torch_dtype=torch_dtype, config=model_config, attn_implementation="sdpa",
        trust_remote_code=trust_remote_code)


def use_cpu_platform() -> None:
    """Select the CPU platform for this process and register verl's FSDP engines for it."""
    import verl.utils.model

    os.environ["VERL_PLATFORM"] = "cpu"
    set_platform(PlatformCPU())
    _register_cpu_engines()
    verl.utils.model.load_valuehead_model = _load_value_model_sdpa  # the critic (PPO/GAE) on CPU
