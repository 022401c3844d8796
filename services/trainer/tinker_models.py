"""The Tinker training clients this trainer serves, each model a LoRA slot on the shared-base engine of its base
model (lora_shared_engine.py), its operations applied in `seq_id` order and answered in their futures
(`tinker:future:<request id>`, where the API's `retrieve_future` reads them).

A model is held by one trainer of the fleet (its run's trainer lease), which reads the model's own stream
(`tinker.ops.<model id>`); `tinker.requests` wakes the fleet when a model has work, and a model whose holder died
is taken over, pending operations and all, once its lease expired. Adapter and gradients live in the holder's
memory; `save_weights` puts adapter and Adam state in STATE_DIR, `save_weights_for_sampler` the adapter on the
weight server. A new holder resumes a model from its last `save_weights`, or, with none, says its weights are
lost instead of training a fresh adapter in their place. More: docs/tinker.md#training-operations
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from services.trainer import run_store as db
from shared.contracts.messages import TinkerCheckpoint, TinkerFuture, TinkerOp, TinkerWake
from shared.contracts.streams import GROUP_TRAIN, TINKER_REQUESTS, tinker_key, tinker_model_ops
from shared.contracts.tinker_run import (
    FUTURE_TTL_S,
    LOSS_CONFIG,
    MODEL_TTL_S,
    TinkerRunConfig,
    checkpoint_path,
)
from shared.platform.bus import REDIS_DOWN, RedisError, StreamConsumer
from shared.platform.logs import get_logger
from shared.stores.tinker_usage import count_once, count_storage_once
from shared.weights.age import encrypt_files
from shared.weights.manifest import fsync_path, fsync_tree

log = get_logger(__name__)


# -- losses: Tinker's definitions, per token (summed over a datum's tokens; `mask` marks real tokens) -----------
def cross_entropy(logp: torch.Tensor, d: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    return -logp * d["weights"]


def ratio(logp: torch.Tensor, d: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each token's probability over the sampler's."""
    return torch.exp(logp - d["logprobs"])


def importance_sampling(logp: torch.Tensor, d: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    return -ratio(logp, d) * d["advantages"]


def clipped(r: torch.Tensor, config: dict) -> torch.Tensor:
    return r.clamp(config["clip_low_threshold"], config["clip_high_threshold"])


def clipped_objective(r: torch.Tensor, d: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """PPO's pessimistic objective: the lesser of the ratio's and the clipped ratio's advantage."""
    return -torch.minimum(r * d["advantages"], clipped(r, config) * d["advantages"])


def ppo(logp: torch.Tensor, d: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    return clipped_objective(ratio(logp, d), d, config)


def gspo(logp: torch.Tensor, d: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    # GSPO-token: every token's ratio has its sequence's value (the geometric mean of the token ratios over
    # `sequence_ratio_mask`) and its own logprob's gradient. verl's gspo averages over the whole response and
    # aggregates the batch; Tinker's ratio covers the masked tokens only and its losses are sums.
    mask = d["sequence_ratio_mask"] != 0
    log_ratio = ((logp.detach() - d["logprobs"]) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return clipped_objective(torch.exp(log_ratio.unsqueeze(-1) + logp - logp.detach()), d, config)


def cispo(logp: torch.Tensor, d: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    # the clipped ratio weighs the policy gradient and takes none itself (stop-gradient)
    return -clipped(ratio(logp, d), config).detach() * logp * d["advantages"]


def dro(logp: torch.Tensor, d: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    # a quadratic penalty on the log-ratio keeps the update near the sampler's distribution
    return -(logp * d["advantages"] - 0.5 * config["beta"] * (logp - d["logprobs"]) ** 2)


def stable_reinforce(logp: torch.Tensor, d: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    # REINFORCE at the sampled positions (`weights`, set by the API from the datum's provenance), weighed by the
    # truncated importance ratio over the sampler's recorded logprobs (a stop-gradient weight: ratios above the cap
    # count as the cap, as verl's token-level rollout correction does), plus an optional KL(sampler || policy)
    # penalty (the k3 estimator, unbiased and non-negative)
    log_ratio = logp - d["logprobs"]
    weight = torch.exp(log_ratio).clamp(max=config["truncation"]).detach()
    kl = torch.exp(-log_ratio) + log_ratio - 1
    return (-weight * logp * d["advantages"] + config["kl_coeff"] * kl) * d["weights"]


LOSSES: dict[str, Callable] = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo,
                               "gspo": gspo, "cispo": cispo, "dro": dro, "stable_reinforce": stable_reinforce}
INPUTS = ("weights", "advantages", "logprobs", "sequence_ratio_mask")  # a datum's per-token loss inputs, padded like the responses


def loss_config(name: str, config: dict) -> dict:
    """The loss's config with its defaults filled in (the API refused a request that lacks a required one)."""
    return {k: v for k, v in LOSS_CONFIG.get(name, {}).items() if v is not None} | config


def verl_loss(name: str, config: dict) -> Callable:
    """Loss `name` in verl's loss signature: the sum over the micro-batch's tokens (Tinker's losses are sums)."""
    from verl.workers.utils.padding import no_padding_2_padding

    config = loss_config(name, config)

    def loss(model_output, data, dp_group=None):
        logp = no_padding_2_padding(model_output["log_probs"], data).float()
        inputs = {k: data[f"tinker_{k}"] for k in INPUTS}
        return (LOSSES[name](logp, inputs, config) * data["response_mask"]).sum(), {}

    return loss


def usage_of(op: TinkerOp) -> dict[str, int]:
    """What an applied op counts as usage: the input tokens of its datums (forward, forward_backward), one
    checkpoint (the save ops)."""
    if op.op in ("forward", "forward_backward"):
        return {"training": sum(len(d.tokens) for d in op.data)}
    return {"checkpoint": 1} if op.op.startswith("save_weights") else {}


def tensors(op: TinkerOp, pad_id: int) -> tuple[dict, dict]:
    """The engine's padded batch of the op's datums: each datum's first input token as its prompt and its
    target tokens as its response, so the response log-probs are those of the targets; and the loss inputs."""
    rows = op.data
    B, R = len(rows), max(len(d.target_tokens) for d in rows)
    t = {"prompts": torch.tensor([[d.tokens[0]] for d in rows]), "responses": torch.full((B, R), pad_id),
         "attention_mask": torch.zeros((B, R + 1), dtype=torch.long), "response_mask": torch.zeros((B, R), dtype=torch.long)}
    extra = {f"tinker_{k}": torch.zeros((B, R)) for k in INPUTS}
    for i, d in enumerate(rows):
        n = len(d.target_tokens)
        t["responses"][i, :n] = torch.tensor(d.target_tokens)
        t["attention_mask"][i, :n + 1] = 1
        t["response_mask"][i, :n] = 1
        extra["tinker_weights"][i, :n] = torch.tensor(d.weights) if d.weights is not None else 1.0
        for k in ("advantages", "logprobs", "sequence_ratio_mask"):
            if getattr(d, k) is not None:
                extra[f"tinker_{k}"][i, :n] = torch.tensor(getattr(d, k))
        if d.sequence_ratio_mask is None:  # gspo's default: the tokens with a nonzero advantage
            extra["tinker_sequence_ratio_mask"][i] = (extra["tinker_advantages"][i] != 0).float()
    t["input_ids"] = torch.cat([t["prompts"], t["responses"]], dim=1)
    t["position_ids"] = (t["attention_mask"].cumsum(1) - 1).clamp(min=0)
    return t, extra


def outputs(op: TinkerOp, t: dict, extra: dict, logp: torch.Tensor) -> list[dict[str, list[float]]]:
    """Per datum: the targets' log-probs and each token's loss (Tinker's `logprobs`, `elementwise_loss`)."""
    inputs = {k: extra[f"tinker_{k}"] for k in INPUTS}
    elementwise = LOSSES[op.loss_fn](logp, inputs, loss_config(op.loss_fn, op.loss_fn_config)) * t["response_mask"]
    return [{"logprobs": logp[i, :len(d.target_tokens)].tolist(),
             "elementwise_loss": elementwise[i, :len(d.target_tokens)].tolist()} for i, d in enumerate(op.data)]


@dataclass
class TinkerModel:
    run_id: str
    config: TinkerRunConfig
    engine: object
    pad_id: int
    last_seq: int = 0  # the last seq_id applied


def stored_in(record: TinkerCheckpoint) -> tuple | None:
    """Where a checkpoint's storage is, shared by its copies: a save_state's folder, an export, or the weight
    server's version of sampler weights (pinned there when the save was named)."""
    if record.folder:
        return ("folder", str(Path(record.folder).resolve()))
    if record.kind == "external_weights":
        return ("export", record.run_id, record.name)
    if record.kind == "sampler_weights" and record.version is not None:
        return ("version", record.run_id, record.version)
    return None


class OpFailed(Exception):
    """An operation that cannot be applied; `category` is the SDK's (user: the caller's to fix)."""

    def __init__(self, message: str, category: str = "user"):
        super().__init__(message)
        self.category = category


class TinkerModels:
    def __init__(self, trainer):
        self.trainer = trainer
        self.wakes = self.queue(TINKER_REQUESTS, TinkerWake)
        self.held: dict[str, tuple[str, StreamConsumer]] = {}  # model id -> its run, its operations' stream
        self.models: dict[str, TinkerModel] = {}  # the held models opened (their first operation came)
        self.foreign: dict[str, float] = {}  # model id -> until when another trainer is known to hold it
        self.next_scan = 0.0  # when to look for models whose holder is gone

    def queue(self, stream: str, expect: type) -> StreamConsumer:
        # entries are held for as long as they take (a model's whole step), never reclaimed on a timer
        return StreamConsumer(self.trainer.bus, stream, GROUP_TRAIN, self.trainer.worker_id, expect=expect,
                              max_deliveries=None, claim_idle_ms=None, block_ms=None)

    async def start(self) -> None:
        await self.wakes.start()
        async for deliveries in self.wakes.take_over_pending():  # a dead trainer's (or our own) unread wakes
            await self.woken(deliveries)

    async def poll(self) -> None:
        await self.woken(await self.wakes.read())
        for _, ops in list(self.held.values()):
            await self.serve(ops, await ops.read())

    async def woken(self, deliveries: list) -> None:
        """Hold each woken model whose lease is free (or ours); one another live trainer holds is left to it (it
        reads the model's stream itself)."""
        now = time.monotonic()
        for model_id, run_id in {d.message.model_id: d.message.run_id for d in deliveries}.items():
            if model_id not in self.held and self.foreign.get(model_id, 0.0) <= now:
                await self.hold(model_id, run_id)
        await self.wakes.ack(deliveries)

    async def hold(self, model_id: str, run_id: str) -> None:
        if run_id not in await self.trainer._leases([run_id]):
            # asked again only after a while: its holder's wakes need no database round trip each
            self.foreign[model_id] = time.monotonic() + self.trainer.settings.lease_ttl_s / 3
            return
        self.foreign.pop(model_id, None)
        ops = self.queue(tinker_model_ops(model_id), TinkerOp)
        try:
            await ops.start()
        except REDIS_DOWN as e:  # its lease is ours: the scan for unheld models tries again
            log.warning("cannot read the operations of tinker model %s yet: %r", model_id, e)
            return
        self.held[model_id] = (run_id, ops)
        log.info("holding tinker model %s", model_id, extra={"run_id": run_id})
        try:
            async for deliveries in ops.take_over_pending():  # what a holder that died left unanswered
                await self.serve(ops, deliveries)
        except REDIS_DOWN as e:  # not all taken over: held again by the next scan, which takes over the rest
            log.warning("taking over tinker model %s's pending operations stopped: %r", model_id, e)
            del self.held[model_id]

    async def take_over_orphans(self) -> None:
        """Hold the models whose lease lapsed (their holder died) while operations wait on their stream: their
        wakes were read while the dead holder's lease still stood, so none will come for them."""
        if time.monotonic() < self.next_scan:
            return
        self.next_scan = time.monotonic() + self.trainer.settings.lease_ttl_s / 3
        self.foreign = {m: t for m, t in self.foreign.items() if t > time.monotonic()}
        unheld = await asyncio.to_thread(db.unheld_tinker_models, self.trainer.db, self.trainer.worker_id)
        unheld = {m: r for m, r in unheld.items() if m not in self.held}
        try:
            waiting = await self.waiting([tinker_model_ops(m) for m in unheld])
        except REDIS_DOWN:
            return
        for (model_id, run_id), wait in zip(unheld.items(), waiting, strict=True):
            if wait:
                await self.hold(model_id, run_id)

    async def waiting(self, streams: list[str]) -> list[bool]:
        """Per stream, whether it holds operations not yet answered (pending, or never read), in one round trip."""
        async with self.trainer.redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xinfo_groups(stream)
            infos = await pipe.execute(raise_on_error=False)
        out = []
        for info in infos:
            if isinstance(info, Exception):  # no such stream: no operation was ever sent (or it expired)
                out.append(False)
                continue
            group = next((g for g in info if g["name"] in (GROUP_TRAIN, GROUP_TRAIN.encode())), None)
            out.append(group is None or group["pending"] > 0 or group.get("lag") != 0)  # lag None: unknown
        return out

    async def serve(self, ops: StreamConsumer, deliveries: list) -> None:
        # in seq_id order (the SDK sends them so; a read may still hold several)
        for d in sorted(deliveries, key=lambda d: d.message.seq_id):
            await self.answer(d.message, await self.apply(d.message))
            await ops.ack([d])

    async def apply(self, op: TinkerOp) -> dict:
        started = time.monotonic()
        try:
            model = await self.model(op)
            if op.seq_id and op.seq_id <= model.last_seq:
                raise OpFailed(f"operation seq_id {op.seq_id} of {op.model_id} was applied already "
                               f"(last applied: {model.last_seq}); a retried request is not applied twice")
            source = await self.checkpoint(op) if op.op == "load_weights" else None
            result = await self.trainer._in_torch(self.run_op, model, op, source)
            model.last_seq = op.seq_id
            if isinstance(result, TinkerCheckpoint):  # durable: recorded, then answered
                await self.record_checkpoint(result)
                result = {"type": op.op, "path": checkpoint_path(op.model_id, result.kind, result.name),
                          **({"sampling_session_id": op.sampling_session_id} if op.sampling_session_id else {}),
                          **({"size_bytes": result.size_bytes} if result.size_bytes is not None else {})}
            await self.until_written(f"seq {op.seq_id} of {op.model_id}", lambda: self.trainer.redis.set(
                tinker_key("model_seq", op.model_id), op.seq_id, ex=MODEL_TTL_S))
            log.info("tinker %s of %s (seq %d) in %.2fs", op.op, op.model_id, op.seq_id, time.monotonic() - started,
                     extra={"run_id": op.run_id})
            return result
        except OpFailed as e:
            return {"error": str(e), "category": e.category}
        except Exception as e:  # the model's engine failed: the client learns why, the trainer goes on
            log.exception("tinker %s of %s failed", op.op, op.model_id, extra={"run_id": op.run_id})
            return {"error": f"{op.op} failed on the trainer: {e!r}", "category": "server"}

    def run_op(self, model: TinkerModel, op: TinkerOp, source: TinkerCheckpoint | None = None):
        if op.op == "save_weights":
            return self.save_state(model, op)
        if op.op == "save_weights_for_sampler":
            return self.save_for_sampler(model, op)
        if op.op == "save_weights_external":
            return self.save_external(model, op)
        if op.op == "load_weights":
            self.load_state(model, source, op.optimizer)
            return {"type": "load_weights", "path": op.path, "model_id": op.model_id}
        if op.op == "optim_step":
            a = op.adam
            metrics = model.engine.optim_step(a.learning_rate, (a.beta1, a.beta2), a.eps, a.weight_decay,
                                              a.grad_clip_norm)
            return {"type": "optim_step", "metrics": {f"{k}:mean": v for k, v in metrics.items()}}
        t, extra = tensors(op, model.pad_id)
        if op.op == "forward":
            logp = model.engine.log_probs(t)[0]
        else:
            logp, _ = model.engine.forward_backward(t, verl_loss(op.loss_fn, op.loss_fn_config), extra)
        out = outputs(op, t, extra, logp)
        loss = sum(sum(o["elementwise_loss"]) for o in out)
        return {"type": "forward_backward", "loss_fn_outputs": out, "metrics": {"loss:sum": loss}}

    # -- checkpoints ------------------------------------------------------------------------------------------
    def checkpoint_record(self, model: TinkerModel, op: TinkerOp, kind: str, **where) -> TinkerCheckpoint:
        now = time.time()
        return TinkerCheckpoint(owner=op.owner, model_id=op.model_id, run_id=model.run_id, kind=kind, name=op.name,
                                base_model=model.config.base_model, lora=model.config.lora, seq_id=op.seq_id,
                                created_at=now, expires_at=now + op.ttl_s if op.ttl_s else None,
                                user_metadata=op.user_metadata, **where)

    def save_state(self, model: TinkerModel, op: TinkerOp) -> TinkerCheckpoint:
        """Adapter and Adam state (verl's checkpoint) under STATE_DIR/tinker/<run>/<name>, renamed into place."""
        root = self.trainer.settings.state_dir / "tinker" / model.run_id
        root.mkdir(parents=True, exist_ok=True)
        final, tmp = root / op.name, root / f".{op.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.engine.save(tmp, op.seq_id)
        fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_path(root)
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        return self.checkpoint_record(model, op, "weights", folder=str(final), size_bytes=size)

    def save_for_sampler(self, model: TinkerModel, op: TinkerOp) -> TinkerCheckpoint:
        """The adapter, published on the weight server as version `seq_id` of the model's run (rollout workers
        load it like any LoRA run's version). A named save is pinned there: kept until the sweep finds no live
        record naming it (a sampler's own save, `save_weights_and_get_sampling_client`, is kept as retention
        keeps the run's newest versions)."""
        published = self.trainer.publisher.publish_adapter(model.run_id, op.seq_id, model.engine,
                                                           model.config.model, {},
                                                           pinned=op.sampling_session_id is None)
        return self.checkpoint_record(model, op, "sampler_weights", version=op.seq_id, size_bytes=published.bytes)

    def save_external(self, model: TinkerModel, op: TinkerOp) -> TinkerCheckpoint:
        """The adapter in PEFT's layout (adapter_config.json, adapter_model.safetensors), each file encrypted to
        the op's age recipients when it names any (stored as `<file>.age`), uploaded to the weight server as an
        export of the model's run, which its owner downloads through signed URLs."""
        folder = self.trainer.publisher.staging_folder(model.run_id, op.seq_id)
        model.engine.export_adapter(folder, "auto")
        if op.age_recipients:
            encrypt_files(folder, op.age_recipients)
        files = self.trainer.publisher.export(model.run_id, op.name, folder)
        return self.checkpoint_record(model, op, "external_weights", files=files, size_bytes=sum(files.values()))

    @staticmethod
    def load_state(model: TinkerModel, source: TinkerCheckpoint, optimizer: bool) -> None:
        model.engine.load(source.folder)
        if not optimizer:  # the weights alone: Adam starts afresh (only this model's state is in the engine now)
            model.engine.actor.engine.optimizer.state.clear()

    async def saved(self, path: str) -> TinkerCheckpoint | None:
        """The checkpoint recorded at `path`, None when there is none or it expired (deleted, or past its ttl)."""
        raw = await self.trainer.redis.get(tinker_key("checkpoint", path))
        record = TinkerCheckpoint.model_validate_json(raw) if raw else None
        return record if record is not None and record.live(time.time()) else None

    async def checkpoint(self, op: TinkerOp) -> TinkerCheckpoint:
        record = await self.saved(op.path)
        # another key's checkpoint loads once its owner published it (tinker:published:<path>, set by the API)
        if record is None or (record.owner != op.owner
                              and not await self.trainer.redis.exists(tinker_key("published", op.path))):
            raise OpFailed(f"checkpoint {op.path} does not exist")
        if record.kind != "weights":
            raise OpFailed(f"{op.path} holds sampler weights; load_state takes a save_state checkpoint "
                           "(tinker://<model>/weights/<name>)")
        model = self.models[op.model_id]
        if (record.base_model, record.lora.get("rank")) != (model.config.base_model, model.config.lora.get("rank")):
            raise OpFailed(f"{op.path} is a rank-{record.lora.get('rank')} adapter of {record.base_model}; model "
                           f"{op.model_id} is rank {model.config.lora.get('rank')} on {model.config.base_model}")
        return record

    async def sweep_checkpoints(self) -> None:
        """Remove what expired checkpoints hold: a save_state's folder under this trainer's STATE_DIR, an export on
        the weight server, the pin of sampler weights' version (the weight server's retention then removes it),
        then the record. Storage a live record shares (a copy_weights copy, or its source) is kept. A folder under
        another STATE_DIR is left, record and all, to the trainer that wrote it. Redis out of reach: the next
        sweep tries again (training goes on)."""
        try:
            await self._sweep(time.time(), (self.trainer.settings.state_dir / "tinker").resolve())
        except RedisError as e:
            log.warning("tinker checkpoint sweep skipped: Redis is out of reach (%s)", e)

    async def _sweep(self, now: float, root: Path) -> None:
        # `now` is the sweep's start: a record copied or deleted meanwhile is live at it, so what a copy made during
        # the sweep shares is never removed
        records = {}
        async for key in self.trainer.redis.scan_iter(match=tinker_key("checkpoint", "tinker://*"), count=500):
            raw = await self.trainer.redis.get(key)
            if raw:
                records[key] = TinkerCheckpoint.model_validate_json(raw)
        shared = {stored_in(r) for r in records.values() if r.live(now)}
        for key, record in records.items():
            if record.live(now):
                continue
            storage = stored_in(record)
            if storage is not None and storage not in shared:
                if record.folder:
                    folder = Path(record.folder).resolve()
                    if root not in folder.parents:
                        continue
                    await asyncio.to_thread(shutil.rmtree, folder, True)
                if storage[0] in ("export", "version"):
                    publisher = self.trainer.publisher
                    call = ((publisher.delete_export, record.run_id, record.name) if storage[0] == "export"
                            else (publisher.unpin, record.run_id, record.version))
                    try:
                        await asyncio.to_thread(*call)
                    except (TimeoutError, httpx.HTTPError) as e:  # the weight server is away: the next sweep tries
                        log.warning("tinker checkpoint %s not removed yet: %r", key, e)
                        continue
            path = checkpoint_path(record.model_id, record.kind, record.name)
            pipe = self.trainer.redis.pipeline(transaction=True)  # its storage counted as it goes: once, whole
            if record.size_bytes:
                count_storage_once(pipe, record.owner, f"storage:{path}:{record.created_at}", record.base_model,
                                   record.size_bytes, record.created_at, record.expires_at)
            pipe.delete(key)
            await pipe.execute()
            log.info("removed tinker checkpoint %s (deleted or past its ttl)", path, extra={"run_id": record.run_id})

    async def record_checkpoint(self, record: TinkerCheckpoint) -> None:
        path = checkpoint_path(record.model_id, record.kind, record.name)
        await self.until_written(path, lambda: self.trainer.redis.set(tinker_key("checkpoint", path),
                                                                      record.model_dump_json()))
        if record.kind == "weights":  # where a restarted trainer resumes the model
            await self.until_written(path, lambda: self.trainer.redis.set(
                tinker_key("model_state", record.model_id), path, ex=MODEL_TTL_S))

    @staticmethod
    async def until_written(what: str, write: Callable) -> None:
        """A Redis write that follows an applied operation (its seq, its checkpoint, its answer), tried again
        until Redis answers: the model changed, so its client must learn so (an error in the future would be a
        lie, and one raised here would stop the trainer's loop)."""
        delay = 0.25
        while True:
            try:
                await write()
                return
            except REDIS_DOWN as e:
                log.warning("tinker: writing %s waits for Redis (%r)", what, e)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)

    # -- models -----------------------------------------------------------------------------------------------
    async def model(self, op: TinkerOp) -> TinkerModel:
        """The op's model, opened on first use: its lease taken, its run active, its state never lost."""
        model = self.models.get(op.model_id)
        if model is not None:
            return model
        row = await asyncio.to_thread(db.load_run, self.trainer.db, op.run_id)
        if row is None or row.kind != "tinker":
            raise OpFailed(f"model {op.model_id} has no tinker run {op.run_id}")
        if row.status != "running":
            raise OpFailed(f"model {op.model_id}'s run is {row.status} (its session finished, or it was stopped)")
        config = TinkerRunConfig.model_validate(row.config)
        applied = await self.trainer.redis.get(tinker_key("model_seq", op.model_id))
        saved = await self.trainer.redis.get(tinker_key("model_state", op.model_id))
        state = await self.saved(saved.decode()) if saved else None
        if applied is not None and state is None:
            raise OpFailed(f"the trainer that held model {op.model_id} restarted after applying its operations up to "
                           f"seq_id {int(applied)} with no save_state before: its weights are lost; create a new "
                           "model (or save_state regularly to resume from the last one)", "server")
        model = await self.trainer._in_torch(self.open, op.run_id, config)
        if applied is not None:  # trained by a trainer that is gone: from its last saved state on
            await self.trainer._in_torch(self.load_state, model, state, True)
            model.last_seq = state.seq_id
            log.warning("tinker model %s resumed from %s (seq_id %d); its operations %d..%s since are lost",
                        op.model_id, saved.decode(), state.seq_id, state.seq_id + 1, int(applied),
                        extra={"run_id": op.run_id})
        self.models[op.model_id] = model
        log.info("serving tinker model %s (rank %d on %s)", op.model_id, config.lora["rank"], config.base_model,
                 extra={"run_id": op.run_id})
        return model

    def open(self, run_id: str, config: TinkerRunConfig) -> TinkerModel:
        from services.trainer.lora_shared_engine import open_engine

        s = self.trainer.settings
        engine = open_engine(run_id, config.model, config.algorithm(), seed=config.lora.get("seed") or 0,
                             device=s.device, dtype=s.dtype, **s.engine_options())
        tokenizer = engine.model_config.tokenizer
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        return TinkerModel(run_id, config, engine, pad_id)

    async def answer(self, op: TinkerOp, result: dict) -> None:
        """The op's future, and with it (one transaction) what the op used: the tokens of a forward or
        forward_backward, a saved checkpoint; an op that failed used nothing."""
        record = TinkerFuture(owner=op.owner, model_id=op.model_id, result=result, answered_at=time.time())
        model = self.models.get(op.model_id)
        counts = {} if "error" in result or model is None else usage_of(op)

        async def write() -> None:
            pipe = self.trainer.redis.pipeline(transaction=True)
            pipe.set(tinker_key("future", op.request_id), record.model_dump_json(), ex=FUTURE_TTL_S)
            count_once(pipe, op.owner, op.request_id, model.config.session_id if model else None,
                       model.config.base_model if model else None, counts, record.answered_at)
            await pipe.execute()

        await self.until_written(f"the answer of {op.request_id}", write)

    async def renew(self) -> None:
        """Keep the leases of the models held; let go of those whose run ended or whose lease another took; take
        over the models whose holder died."""
        if self.held:
            runs = {run_id: model_id for model_id, (run_id, _) in self.held.items()}
            leased = await self.trainer._leases(list(runs))
            for run_id, model_id in runs.items():
                row = await asyncio.to_thread(db.load_run, self.trainer.db, run_id)
                if run_id not in leased or row is None or row.status != "running":
                    await self.close(model_id)
        await self.take_over_orphans()

    async def close(self, model_id: str | None = None) -> None:
        from services.trainer.lora_shared_engine import close_engine

        for mid in [model_id] if model_id else list(self.held):
            run_id, _ = self.held.pop(mid)
            model = self.models.pop(mid, None)
            if model is not None:
                await self.trainer._in_torch(close_engine, model.run_id)
            await asyncio.to_thread(db.release_leases, self.trainer.db, self.trainer.worker_id, [run_id])
            log.info("let go of tinker model %s", mid, extra={"run_id": run_id})
