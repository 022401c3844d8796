"""The policy (and optional KL reference) as verl FSDP2 engines, driven through verl's `TrainingWorker`.

verl does the forward/backward, the PPO loss (`verl.workers.utils.losses.ppo_loss`), gradient clipping, the
optimizer step and the sharded checkpoints. This module only converts our padded tensors into verl's
no-padding TensorDict and back. On CPU it first selects the CPU platform and creates the gloo process group
(otherwise verl asks for CUDA, and its TrainingWorker, started without Ray, builds the duplicated backend
string `cpu:gloo,cpu:gloo`); on GPU verl creates its own process group (`torchrun` sets RANK/WORLD_SIZE for
multi-GPU).
"""

from __future__ import annotations

import os
import socket
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from shared.contracts.run_config import AlgorithmConfig
from shared.platform.logs import get_logger

log = get_logger(__name__)
TENSOR_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


def setup_distributed(device: str) -> None:
    """Single-process defaults for RANK/WORLD_SIZE/MASTER_*; on CPU also the CPU platform and gloo group.
    Outside torchrun a fresh MASTER_PORT is always picked: an inherited one may belong to the parent."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ[key] = os.environ.get(key, value) if launched else value
    if not launched and not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cpu":
        from services.trainer.cpu_platform import use_cpu_platform

        use_cpu_platform()
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=size)
    elif launched and not dist.is_initialized():  # ranks exchange engine calls before verl builds anything
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=size)


class PolicyEngine:
    """One policy under training (plus a frozen reference when kl_coef > 0). A LoRA policy (`algo.lora`) trains
    the adapter only: the base is frozen (no gradients, so no optimizer state), and the reference is the same
    model with the adapter switched off (verl's `no_lora_adapter`), not a second copy."""

    def __init__(self, model_path: str, algo: AlgorithmConfig, *, device: str = "cpu", dtype: str = "fp32",
                 micro_batch_size: int = 8, group_size: int = 1, temperature: float = 1.0,
                 lr_warmup_steps: int = 0, remove_padding: bool = False, micro_batch_tokens: int | None = None,
                 attn_implementation: str = "sdpa", fused_backend: str | None = "auto", lora: dict | None = None,
                 engine_options: dict | None = None, compile_layers: bool = False, use_liger: bool = False):
        """`micro_batch_tokens` set: verl's dynamic batch size, micro-batches formed by a token budget (each
        holds sequences whose lengths sum to at most this; a longer sequence gets one of its own) instead of
        `micro_batch_size` rows. `remove_padding`: sequences are packed end to end into one row per micro-batch
        (verl's `use_remove_padding`), so no compute goes into padding; the attention stays per sequence
        (flash-attn varlen where installed, else transformers' block-diagonal mask built from the restarting
        position ids). `attn_implementation` is the HF attention (sdpa, flex_attention, flash_attention_2);
        `fused_backend` verl's fused linear + log-prob kernel (torch: chunked, fp32 logits per chunk;
        chunked_triton: the same chunks, the vocabulary math in Triton over bf16 logits, logprob_kernel.py; liger:
        liger-kernel's; auto: torch on CUDA, none on CPU,
        where the trainer service turns it on for packed sequences: verl patches the model class's forward for it,
        so an in-process HF model of that class, as the demos and tests use beside an engine, stops working);
        `lora` verl's LoRA fields of the model config (lora_rank, lora_alpha, target_modules; default: those of
        `algo.lora`); `engine_options` more `FSDPEngineConfig` fields
        (the GPU bench tries reshard_after_forward and the like). `compile_layers`: each decoder layer's forward
        through torch.compile (verl's own flag compiles only the entropy function); FSDP2's hooks stay outside.
        `use_liger`: liger-kernel's fused RMSNorm, SwiGLU and RoPE in the model (verl's `use_liger`; CUDA)."""
        setup_distributed(device)
        from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig

        from services.trainer.algorithm import actor_config

        self.algo, self.temperature, self.micro_batch_size = algo, temperature or 1.0, micro_batch_size
        lora = lora or (algo.lora.verl_fields() if algo.lora else None)
        self.is_lora = bool(lora and lora.get("lora_rank", 0) > 0)
        self.engine_config = FSDPEngineConfig(
            strategy="fsdp2", model_dtype=dtype, dtype="float32" if dtype == "fp32" else "bfloat16",
            mixed_precision={"param_dtype": dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            use_torch_compile=False, use_dynamic_bsz=micro_batch_tokens is not None,
            max_token_len_per_gpu=micro_batch_tokens, infer_max_token_len_per_gpu=micro_batch_tokens,
            micro_batch_size_per_gpu=micro_batch_size, infer_micro_batch_size_per_gpu=micro_batch_size,
            **(engine_options or {}))
        self.optim_config = FSDPOptimizerConfig(lr=algo.lr, weight_decay=algo.weight_decay, clip_grad=algo.grad_clip,
                                                lr_warmup_steps=lr_warmup_steps)
        self.actor_config = actor_config(algo, self.engine_config, self.optim_config, batch_size=micro_batch_size,
                                         micro_batch_size=micro_batch_size, group_size=group_size)
        if fused_backend == "auto":
            fused_backend = "torch" if device != "cpu" else None
        if fused_backend and not _ties_embeddings(model_path):
            # verl's fused kernel reads lm_head.weight outside lm_head's forward; FSDP2 keeps an untied head
            # sharded until then ("mixed torch.Tensor and DTensor"), so untied models take the unfused path
            log.info("model %s has an untied output layer: verl's fused log-prob kernel is not used", model_path)
            fused_backend = None
        if fused_backend:
            from services.trainer import logprob_kernel

            # chunked_triton: verl's chunked torch kernel with the vocabulary math in Triton (logprob_kernel.py)
            logprob_kernel.use(fused_backend == "chunked_triton")
            fused_backend = "torch" if fused_backend == "chunked_triton" else fused_backend
        model_config = partial(_model_config, model_path, remove_padding=remove_padding, attn=attn_implementation,
                               fused_backend=fused_backend, lora=lora, use_liger=use_liger)
        self.model_config = model_config()
        self.actor = self._worker(self.model_config, forward_only=False)
        if self.is_lora and algo.lora is not None and algo.lora.dropout > 0:
            _set_lora_dropout(self.peft_model, algo.lora.dropout)
        if compile_layers:
            _compile_decoder_layers(self.actor.engine.module, dynamic=micro_batch_tokens is not None)
        # verl builds forward-only engines with pinned-memory CPU offload, which needs an accelerator: on CPU
        # the frozen reference is an ordinary engine that is simply never updated. LoRA: the actor with its
        # adapter off is the reference (what verl's trainers do for LoRA: `ref_in_actor`).
        self.ref = (self._worker(model_config(), forward_only=device != "cpu")
                    if algo.kl_coef > 0 and not self.is_lora else None)
        # a value head has no vocabulary projection: no fused log-prob kernel
        self.critic = self._critic(model_config(fused_backend=None)) if algo.adv_estimator == "gae" else None

    def _worker(self, model_config, *, forward_only: bool):
        from copy import deepcopy

        from verl.workers.config import TrainingWorkerConfig
        from verl.workers.config.checkpoint import CheckpointConfig
        from verl.workers.engine_workers_tinker import TinkerTrainingWorker
        from verl.workers.utils.losses import ppo_loss

        engine_config = deepcopy(self.engine_config)
        engine_config.forward_only = forward_only
        # verl's TrainingWorker plus Tinker's split primitives (forward_backward, optimizer_step)
        worker = TinkerTrainingWorker(TrainingWorkerConfig(
            model_type="language_model", model_config=model_config, engine_config=engine_config,
            optimizer_config=None if forward_only else self.optim_config,
            checkpoint_config=CheckpointConfig(save_contents=["model", "optimizer", "extra"],
                                               load_contents=["model", "optimizer", "extra"])))
        worker.reset()
        worker.set_loss_fn(partial(ppo_loss, self.actor_config))
        return worker

    def _critic(self, model_config):
        """PPO's value model: the policy's backbone with a value head, trained with verl's value loss."""
        from copy import deepcopy

        from verl.workers.config import FSDPCriticConfig, FSDPOptimizerConfig, TrainingWorkerConfig
        from verl.workers.config.checkpoint import CheckpointConfig
        from verl.workers.engine_workers import TrainingWorker
        from verl.workers.utils.losses import value_loss

        optim = FSDPOptimizerConfig(lr=self.algo.critic_lr, weight_decay=self.algo.weight_decay,
                                    clip_grad=self.algo.grad_clip)
        worker = TrainingWorker(TrainingWorkerConfig(
            model_type="value_model", model_config=model_config, engine_config=deepcopy(self.engine_config),
            optimizer_config=optim, checkpoint_config=CheckpointConfig(
                save_contents=["model", "optimizer", "extra"], load_contents=["model", "optimizer", "extra"])))
        worker.reset()
        self.critic_config = FSDPCriticConfig(
            strategy="fsdp2", ppo_micro_batch_size_per_gpu=self.micro_batch_size,
            ppo_mini_batch_size=self.micro_batch_size, loss_agg_mode=self.algo.loss_agg_mode,
            fsdp=self.engine_config, optim=optim, model=model_config)
        worker.set_loss_fn(partial(value_loss, self.critic_config))
        return worker

    # -- tensors ----------------------------------------------------------------------------------------------
    def _tensordict(self, t: dict, extra: dict | None = None, **meta):
        from tensordict import TensorDict
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        td = TensorDict({k: t[k] for k in TENSOR_KEYS} | (extra or {}), batch_size=[t["input_ids"].shape[0]])
        td = left_right_2_no_padding(td)
        tu.assign_non_tensor(td, temperature=self.temperature, **({"calculate_entropy": True} | meta))
        return td

    def _micro(self, rows: int) -> int:
        """Largest micro-batch <= the configured one that divides `rows` (verl requires exact division)."""
        return next(m for m in range(min(self.micro_batch_size, rows), 0, -1) if rows % m == 0)

    def _response_values(self, nested: torch.Tensor, t: dict) -> torch.Tensor:
        from tensordict import TensorDict
        from verl.workers.utils.padding import no_padding_2_padding

        view = TensorDict({k: t[k] for k in ("prompts", "responses", "attention_mask")},
                          batch_size=[t["input_ids"].shape[0]])
        return no_padding_2_padding(nested, view).float() * t["response_mask"]

    # -- verl calls -------------------------------------------------------------------------------------------
    @property
    def has_reference(self) -> bool:
        """Whether the loss has a KL-to-reference term (`log_probs(reference=True)` then gives its log-probs)."""
        return self.algo.kl_coef > 0

    @property
    def peft_model(self):
        """The PEFT model under FSDP (LoRA only)."""
        module = self.actor.engine.module
        return getattr(module, "_fsdp_wrapped_module", module)

    def log_probs(self, t: dict, *, reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies of the responses under the current (or reference) policy."""
        worker = self.ref if reference and not self.is_lora else self.actor
        rows = t["input_ids"].shape[0]
        meta = {"no_lora_adapter": True} if reference and self.is_lora else {}
        out = worker.infer_batch(self._tensordict(t, compute_loss=False, micro_batch_size_per_gpu=self._micro(rows),
                                                  **meta))
        return self._response_values(out["log_probs"], t), self._response_values(out["entropy"], t)

    def values(self, t: dict) -> torch.Tensor:
        """The critic's value estimate per response token (gae only)."""
        rows = t["input_ids"].shape[0]
        out = self.critic.infer_batch(self._tensordict(t, compute_loss=False, calculate_entropy=False,
                                                       micro_batch_size_per_gpu=self._micro(rows)))
        return self._response_values(out["values"], t)

    def update_critic(self, t: dict, values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        from verl.utils import tensordict_utils as tu

        rows = t["input_ids"].shape[0]
        total = rows * dist.get_world_size()
        td = self._tensordict(t, {"values": values, "returns": returns}, compute_loss=True, calculate_entropy=False,
                              global_batch_size=total, mini_batch_size=total, epochs=self.algo.ppo_epochs, seed=0,
                              dataloader_kwargs={"shuffle": False}, micro_batch_size_per_gpu=self._micro(rows))
        out = self.critic.train_mini_batch(td)
        return {k: _mean(v) for k, v in tu.get(out, "metrics").items()}

    def update(self, t: dict, old_log_probs: torch.Tensor, advantages: torch.Tensor, is_weights: torch.Tensor,
               ref_log_probs: torch.Tensor | None = None, seed: int = 0) -> dict[str, float]:
        """ppo_epochs x ppo_mini_batches optimizer steps of verl's PPO loss on this batch; verl's metrics."""
        from verl.utils import tensordict_utils as tu

        rows = t["input_ids"].shape[0]  # this rank's rows; verl's batch sizes are global (all ranks)
        batch_size = rows * dist.get_world_size()
        minis = self.algo.ppo_mini_batches if rows % self.algo.ppo_mini_batches == 0 else 1
        extra = {"old_log_probs": old_log_probs, "advantages": advantages, "rollout_is_weights": is_weights}
        if ref_log_probs is not None:
            extra["ref_log_prob"] = ref_log_probs
        # entropy only when the loss uses it (log_probs() reports it for the metrics)
        td = self._tensordict(t, extra, calculate_entropy=self.algo.entropy_coeff > 0, compute_loss=True,
                              global_batch_size=batch_size // minis,
                              mini_batch_size=batch_size // minis, epochs=self.algo.ppo_epochs, seed=seed,
                              dataloader_kwargs={"shuffle": False},
                              micro_batch_size_per_gpu=self._micro(rows // minis))
        out = self.actor.train_mini_batch(td)
        return {k: _mean(v) for k, v in tu.get(out, "metrics").items()}

    def forward_backward(self, t: dict, loss_fn, extra: dict) -> tuple[torch.Tensor, float]:
        """Tinker's split step: the gradients of `loss_fn` (verl's loss signature; `extra` per-token tensors of
        the responses' shape it reads) accumulated in the parameters, no optimizer step. Returns the responses'
        per-token log-probs and the loss."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.losses import ppo_loss

        rows = t["input_ids"].shape[0]
        td = self._tensordict(t, extra, compute_loss=True, calculate_entropy=False,
                              micro_batch_size_per_gpu=self._micro(rows))
        self.actor.set_loss_fn(loss_fn)
        try:
            out = self.actor.forward_backward(td)
        finally:
            self.actor.set_loss_fn(partial(ppo_loss, self.actor_config))
        return self._response_values(out["log_probs"], t), float(tu.get(out, "metrics")["loss"])

    def optim_step(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   grad_clip: float) -> dict[str, float]:
        """Apply the accumulated gradients with these Adam hyperparameters (grad_clip 0: no clipping), then zero
        them (verl's Tinker optimizer_step)."""
        optim = self.actor.engine.optimizer_config
        clip, optim.clip_grad = optim.clip_grad, grad_clip or float("inf")
        try:
            metrics = self.actor.optimizer_step({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        finally:
            optim.clip_grad = clip
        return {k: _mean(v) for k, v in metrics.items()}

    # -- state ------------------------------------------------------------------------------------------------
    def save(self, folder: Path, step: int) -> None:
        self.actor.save_checkpoint(str(folder), global_step=step)
        if self.critic is not None:
            self.critic.save_checkpoint(str(folder / "critic"), global_step=step)

    def load(self, folder: Path) -> None:
        self.actor.load_checkpoint(str(folder))
        if self.critic is not None:
            self.critic.load_checkpoint(str(folder / "critic"))

    def export_hf(self, folder: Path, dtype: str = "auto", *, weights: bool = True, device: str = "cpu") -> dict | None:
        """HF folder (model.safetensors + config + tokenizer) with the current weights in `dtype` (a torch dtype
        name; auto: the model config's dtype, else the training dtype); flat file names. Returns the exported
        tensors on rank 0 (None elsewhere), on `device` (the publisher diffs them where they are);
        `weights=False` leaves out model.safetensors (the publisher writes it only when it sends a full snapshot,
        not for a delta)."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        gen, _ = self.actor.engine.get_per_tensor_param()
        hf_config = self.model_config.hf_config
        tied = getattr(hf_config, "tie_word_embeddings", False)
        if dtype == "auto":
            dtype = getattr(hf_config, "dtype", None) or self.engine_config.model_dtype
        dtype = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}.get(str(dtype), str(dtype)).removeprefix("torch."))
        state = {name: p.detach().to(device, dtype, copy=True).contiguous() for name, p in gen
                 if not (tied and name == "lm_head.weight")}
        if dist.get_rank() != 0:
            return None
        if weights:
            save_file({n: t.cpu() for n, t in state.items()}, str(folder / "model.safetensors"),
                      metadata={"format": "pt"})
        hf_config.save_pretrained(folder)
        self.model_config.tokenizer.save_pretrained(folder)
        if self.model_config.generation_config is not None:
            self.model_config.generation_config.save_pretrained(folder)
        return state

    def export_adapter(self, folder: Path, dtype: str = "auto") -> dict | None:
        """The LoRA adapter alone in PEFT's layout (adapter_config.json + adapter_model.safetensors, the tensor
        names `PeftModel.save_pretrained` writes), in `dtype` as `export_hf`. Returns the tensors on rank 0."""
        from safetensors.torch import save_file

        from shared.weights.manifest import ADAPTER_WEIGHTS

        folder.mkdir(parents=True, exist_ok=True)
        gen, _ = self.actor.engine.get_per_tensor_param(base_sync_done=True)  # the adapter's tensors only
        if dtype == "auto":
            dtype = getattr(self.model_config.hf_config, "dtype", None) or self.engine_config.model_dtype
        dtype = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}.get(str(dtype), str(dtype)).removeprefix("torch."))
        state = {name: p.detach().to("cpu", dtype, copy=True).contiguous() for name, p in gen}
        if dist.get_rank() != 0:
            return None
        save_file(state, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        self.peft_model.peft_config["default"].save_pretrained(str(folder))
        return state

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.actor.engine.module.parameters())


def _model_config(path: str, *, remove_padding: bool, attn: str, fused_backend: str | None, lora: dict | None,
                  use_liger: bool = False):
    """verl's fused linear + log-prob kernel (`fused_backend`, chunked, fp32 inside): without it, verl's unfused
    log-prob path loops in Python over the rows of the logits, one log_softmax each: per sequence when padded,
    per token when packed (16,384 CUDA launches per 16 x 1024 batch made a 0.5B step CPU-bound at 1.8% MFU; on
    CPU, a packed step took 3x as long as with the kernel). Unfused CPU log-probs are plain logits, exact vs HF."""
    from verl.workers.config import HFModelConfig

    return HFModelConfig(path=path, override_config={"attn_implementation": attn}, use_remove_padding=remove_padding,
                         enable_gradient_checkpointing=False, use_fused_kernels=fused_backend is not None,
                         fused_kernel_options={"impl_backend": fused_backend} if fused_backend else {},
                         use_liger=use_liger, **(lora or {}))


def _compile_decoder_layers(model: torch.nn.Module, *, dynamic: bool) -> int:
    """Each decoder layer's forward (the classes the model names in `_no_split_modules`, the units FSDP2 wraps)
    through torch.compile, in place: FSDP2's all-gather and reshard hooks run in the module call, outside the
    compiled forward, as when a layer is compiled before it is sharded. The layers share one forward, so dynamo
    traces it once for all of them (modules' parameters are graph inputs) where shapes agree; packed micro-batches
    vary in length, so they compile with dynamic shapes. Returns how many layers were wrapped."""
    import torch._dynamo

    names = set(getattr(model, "_no_split_modules", None) or [])  # FSDP2 subclasses the model: still there
    layers = [m for m in model.modules() if type(m).__name__.removeprefix("FSDP") in names]
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(layers))
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=dynamic)
    return len(layers)


def _set_lora_dropout(peft_model, p: float) -> None:
    """verl builds the LoRA layers without dropout: put `p` on each adapter's input (the adapter's config says it,
    so the exported adapter_config.json does too)."""
    from torch import nn

    for module in peft_model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, nn.ModuleDict):
            for name in dropouts:
                dropouts[name] = nn.Dropout(p)
    peft_model.peft_config["default"].lora_dropout = p


def _ties_embeddings(path: str) -> bool:
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(path), "tie_word_embeddings", False))


def _mean(v) -> float:
    if isinstance(v, list):
        vals = [float(getattr(x, "value", x)) for x in v]
        return sum(vals) / max(1, len(vals))
    return float(getattr(v, "value", v))
