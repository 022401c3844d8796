"""Runs inside vLLM's worker processes (`worker_extension_cls`), for the in-process engine and for `vllm serve
--worker-extension-cls services.rollout_worker.engines.vllm_worker.FlywheelWorkerExtension`.

`flywheel_reload(weights_path)`: vLLM's `reload_weights` made exact for tied-embedding models.
`flywheel_load_tensors(path)`: only the named tensors of one safetensors file, through the same in-place
reload (the file must hold every tensor of each vLLM layer it touches). `flywheel_weight_digests()`: what the
model computes with, for tests that check the served weights bit for bit.

More: docs/vllm.md#the-worker-extension
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

# vLLM's layerwise reload warns about every layer a partial load leaves alone, which is what a delta means.
_PARTIAL_LOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                         "vllm.model_executor.model_loader.reload.inplace")


class FlywheelWorkerExtension:
    def flywheel_reload(self, weights_path: str) -> dict:
        """{"ok": True, "tied": bool} or {"ok": False, "error": str}: never raises, since an exception in a
        collective RPC takes vLLM's server down with it."""
        try:
            if not any(Path(weights_path).glob("*.safetensors")):
                # vLLM would take a missing folder for a hub id, fail half way and leave the layers empty.
                raise FileNotFoundError(f"{weights_path} has no *.safetensors files to reload from")
            self.reload_weights(weights_path=weights_path)
            return {"ok": True, "tied": self._retie_output_layer()}
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    def flywheel_load_tensors(self, path: str) -> dict:
        """Load the tensors of the safetensors file `path` (checkpoint names) in place; the same replies as
        `flywheel_reload`."""
        try:
            from safetensors import safe_open

            with safe_open(path, "pt") as f:
                weights = [(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118 (not a dict)
            with _quiet(_PARTIAL_LOAD_LOGGERS):
                self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            return {"ok": True, "tied": self._retie_output_layer(), "tensors": len(weights)}
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    def flywheel_packed_modules(self) -> dict[str, list[str]]:
        """The served model's layers that hold several checkpoint tensors, e.g. {"qkv_proj": ["q_proj",
        "k_proj", "v_proj"]}."""
        model = self.model_runner.get_model()
        return {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}

    def flywheel_weight_digests(self) -> dict[str, str]:
        """xxh3-128 of every weight the model computes with, as float32 bytes, by vLLM name: a layer with a
        CPU GEMM kernel (`cpu_linear`) is read back as kernel(identity).T (exact: each output is one weight
        times 1), its bias and every other parameter as stored. For tests; O(in_features^2) memory per layer."""
        import torch
        import xxhash

        def digest(t: torch.Tensor) -> str:
            return xxhash.xxh3_128_hexdigest(t.detach().float().contiguous().cpu().numpy())

        model, dtype, out = self.model_runner.get_model(), self.vllm_config.model_config.dtype, {}
        with torch.inference_mode():
            for name, module in model.named_modules():
                if hasattr(module, "cpu_linear"):  # LinearBase (input_size_per_partition) or the LM head
                    k = getattr(module, "input_size_per_partition", None) or module.embedding_dim
                    out[f"{name}.weight"] = digest(module.cpu_linear(torch.eye(k, dtype=dtype), module.weight, None).T)
                for pname, p in module.named_parameters(recurse=False):
                    if p.numel() and f"{name}.{pname}" not in out:
                        out[f"{name}.{pname}"] = digest(p)
        return out

    def _retie_output_layer(self) -> bool:
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = bool(getattr(model.config, "tie_word_embeddings", False)) and lm_head is not None and embed is not None
        if tied:
            lm_head.weight = embed.weight
            lm_head.quant_method.process_weights_after_loading(lm_head)
        return tied


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]):
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def reload_failure(results: list) -> str | None:
    """The first worker's error among flywheel_reload results, or None when every worker reloaded."""
    for r in results or [None]:
        if not isinstance(r, dict) or not r.get("ok"):
            return r.get("error") if isinstance(r, dict) else f"unexpected reply {r!r}"
    return None
