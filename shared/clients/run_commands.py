"""The one place a run is created, with one set of checks, and the one way to change a run: `POST /v1/runs`
and the eval job both call `create_run`, which checks the run and sends a `create` command to the controller
(the one writer of `runs`); pause, resume and stop go the same way (`run_command`).

A run that cannot work is refused with the reason (`RunRefused`: 404 or 400, every problem listed) instead of
failing every attempt on the workers. What the caller cannot see it does not check (`check_paths=False`).

More: docs/runs.md#checks-when-a-run-is-created
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from sqlalchemy import Connection, Engine, exists, select
from sqlalchemy.dialects.postgresql import array
from sqlalchemy.orm import Session

from shared.contracts.db.models import Dataset, DatasetRow, Run, RunEvent
from shared.contracts.messages import RunCommand, RunCommandReply
from shared.contracts.messages.control import CommandAction
from shared.contracts.registry import REGISTRIES, resolve
from shared.contracts.run_config import RunConfig
from shared.contracts.streams import RUN_COMMANDS, command_reply
from shared.platform.bus import RedisError, SyncRedis, ask
from shared.platform.heartbeats import live_workers
from shared.stores.datasets import DatasetNotFound, count_rows, pin_version

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
TINY_MODEL_HINT = ("to make the tiny test model the examples name, run "
                   "`.venv/bin/python -m tests.support.tiny_model .data/models/tiny-qwen2` in the repo root")


COMMAND_WAIT_S = 10.0  # how long a sender waits for the controller to apply a run command, seconds

DATASET_HINT = "upload it with POST /v1/datasets or `flywheel datasets import`; list them with `flywheel datasets list`"


class Problem(BaseModel):
    """One reason a run cannot work (the API answers each as an error item)."""
    field: str | None = None
    message: str
    hint: str | None = None


class RunRefused(Exception):
    """The run cannot work as given: `status` 404 (its dataset does not exist) or 400, every problem found."""

    def __init__(self, status: int, problems: list[Problem]):
        self.status, self.problems = status, problems
        super().__init__("; ".join(f"{p.field}: {p.message}" if p.field else p.message for p in problems))


def create_run(session: Session, redis_client: SyncRedis, cfg: RunConfig, *, check_paths: bool = True,
               created_by: str | None = None, run_id: uuid.UUID | None = None,
               wait_s: float = COMMAND_WAIT_S) -> tuple[uuid.UUID, int]:
    """Pin the dataset version (the latest unless `cfg` names one), check the run, and have the controller
    create it `pending` (a `create` command; the controller writes the row and its `created` event).
    (run id, the dataset's row count); RunRefused when the run cannot work; ControllerUnavailable when no
    controller created it in time (then it does not exist, and never will from this request). `run_id`: the id
    to give it (a caller that may repeat the request passes the same one, and the controller creates one run);
    a new one otherwise."""
    try:
        cfg.dataset_version, _ = pin_version(session.connection(), cfg.dataset, cfg.dataset_split, cfg.dataset_version)
    except DatasetNotFound as e:
        raise RunRefused(404, [Problem(field="dataset_version" if cfg.dataset_version else "dataset", message=str(e),
                                       hint=DATASET_HINT)]) from e
    num_rows = check_run(session.get_bind(), redis_client, cfg, check_paths)
    run_id = run_id or uuid.uuid4()
    reply = run_command(session, redis_client, run_id, "create", wait_s=wait_s, config=cfg.model_dump(mode="json"),
                        rows=num_rows, created_by=created_by)
    if reply.outcome != "applied":  # the checks above passed, so the controller sees the config differently
        raise RunRefused(400, [Problem(message=f"the controller refused the run: {reply.message}",
                                       hint="the API and the controller may run different versions; update both")])
    return run_id, num_rows


# ---- run commands -----------------------------------------------------------------------------------------


class ControllerUnavailable(Exception):
    """No controller applied a run command before it expired: nothing was changed (the controller refuses a
    command it reads after `expires_at`)."""


def run_command(session: Session, redis_client: SyncRedis, run_id: uuid.UUID | str, action: CommandAction, *,
                wait_s: float = COMMAND_WAIT_S, **create: Any) -> RunCommandReply:
    """Send one `RunCommand` on `run.commands` and wait for the controller's reply (shared/contracts/messages/control.py).

    The command expires `wait_s` after it is sent; this waits a little longer (bus.ANSWER_GRACE_S), so an answer
    from a controller that read it in time still arrives. Without one, the database says whether the command
    was applied anyway (its run, or its `status_changed` event, exists): the answer never reports a change
    that did not happen, nor hides one that did. ControllerUnavailable when it was not applied; RedisError when
    the command could not be sent."""
    now = time.time()
    cmd = RunCommand(command_id=uuid.uuid4().hex, run_id=str(run_id), action=action, sent_at=now,
                     expires_at=now + wait_s, **create)
    reply = ask(redis_client, RUN_COMMANDS, cmd, command_reply(cmd.command_id), RunCommandReply, wait_s)
    if reply is None or reply.outcome == "expired":
        status = _applied_status(session, cmd)
        if status is None:
            raise ControllerUnavailable(
                f"no controller applied the {action} within {wait_s:g} s, so nothing was changed; start one "
                "(`make up` and `docker compose up` do) or check its log, then retry")
        reply = RunCommandReply(command_id=cmd.command_id, outcome="applied", status=status)
    return reply


def _applied_status(session: Session, cmd: RunCommand) -> str | None:
    """The run's status if `cmd` was applied, else None."""
    status = session.execute(select(Run.status).where(Run.id == uuid.UUID(cmd.run_id))).scalar()
    return status if status is not None and command_applied(session.connection(), cmd) else None


def command_applied(conn: Connection, cmd: RunCommand) -> bool:
    """Whether `cmd` was applied, read from what the controller writes with it: a create's run, or a `status_changed`
    event carrying the command's id. The controller applies a command only when this is false (idempotent by
    command id); a sender that got no answer reads it."""
    run_id = uuid.UUID(cmd.run_id)
    if cmd.action == "create":
        return bool(conn.execute(select(exists().where(Run.id == run_id))).scalar())
    return bool(conn.execute(select(exists().where(
        RunEvent.run_id == run_id, RunEvent.data.contains({"command": cmd.command_id})))).scalar())


def check_run(engine: Engine, redis_client: SyncRedis, cfg: RunConfig, check_paths: bool = True) -> int:
    """The dataset's row count; RunRefused (404 or 400, every problem found listed) when the run cannot work."""
    num_rows = count_rows(engine, cfg.dataset, cfg.dataset_split, cfg.dataset_version)
    if num_rows is None:
        raise RunRefused(404, [Problem(field="dataset", hint=DATASET_HINT,
                                       message=f"dataset {cfg.dataset!r} split {cfg.dataset_split!r} does not exist")])
    problems = [*(_model_problems(cfg) if check_paths else []), *_engine_problems(redis_client, cfg),
                *_row_problems(engine, cfg)]
    if problems:
        raise RunRefused(400, problems)
    return num_rows


# ---- model and tokenizer ----------------------------------------------------------------------------------


def _model_problems(cfg: RunConfig) -> list[Problem]:
    fields = [("tokenizer", cfg.tokenizer)] if cfg.tokenizer else []
    if cfg.engine.type != "openai":  # for the openai engine `model` is the server's model name
        fields.insert(0, ("model", cfg.model))
    problems, folders = [], []
    for field, value in fields:
        problem, folder = _locate(field, value)
        problems += [problem] if problem else []
        folders += [folder] if folder else []
    if not problems and folders:
        problems += _context_problems(cfg, folders[0]) + _lora_problems(cfg, folders[0])
    return problems


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or os.path.exists(value)


def _locate(field: str, value: str) -> tuple[Problem | None, Path | None]:
    """(problem, folder holding config.json or None)."""
    where = "relative paths resolve against the API's working directory (the repo root under `make up`)"
    if _looks_like_path(value):
        path = Path(value).expanduser().resolve()
        if not path.exists():
            return Problem(field=field, message=f"model folder {value!r} does not exist (looked at {path})",
                             hint=f"{where}; give an absolute path, or {TINY_MODEL_HINT}"), None
        if not path.is_dir():
            return Problem(field=field, message=f"{value!r} is a file; a model is an HF folder (config.json, "
                                                  "weights, tokenizer files)", hint="give the folder"), None
        return None, path
    return _hub_problem(field, value, where), _cached_config_folder(value)


def _hub_problem(field: str, value: str, where: str) -> Problem | None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return Problem(field=field, message=f"{value!r} is neither a folder that exists nor a hub id (org/name)",
                         hint=f"{where}; {TINY_MODEL_HINT}")
    first = value.split("/", 1)[0]
    if "/" in value and Path(first).is_dir():
        return Problem(field=field, message=f"{value!r} looks like a local path, but that folder does not exist "
                                              f"(./{first} does)", hint=f"{where}; check the path")
    if _cached_config_folder(value) is not None:
        return None
    if _hub_offline():
        return Problem(field=field, message=f"hub id {value!r} is not in the local cache and the hub is offline "
                                              "(HF_HUB_OFFLINE)", hint="download it first, or give a local folder")
    return _hub_lookup(field, value)


HUB_TIMEOUT_S = float(os.environ.get("HUB_TIMEOUT_S", "5"))  # a POST waits this long at most for the hub


def _hub_lookup(field: str, value: str) -> Problem | None:
    """Ask the hub whether it has the model: the workers would otherwise each find out, one retry at a time."""
    import httpx
    from huggingface_hub import constants, get_token

    url = f"{constants.ENDPOINT}/api/models/{value}"
    token = get_token()
    try:
        r = httpx.get(url, timeout=HUB_TIMEOUT_S, headers={"Authorization": f"Bearer {token}"} if token else {})
    except httpx.HTTPError as e:
        return Problem(field=field, message=f"hub id {value!r} is not in the local cache and no hub answered at "
                                              f"{constants.ENDPOINT} within {HUB_TIMEOUT_S:g}s ({e!r})",
                         hint="give a local model folder (download it where the hub is reachable), or set "
                              "HF_ENDPOINT to a hub mirror this machine reaches")
    if r.status_code in (401, 404):  # the hub answers 401 for a repository that does not exist, to anonymous users
        return Problem(field=field, message=f"the hub has no model {value!r} (HTTP {r.status_code} from {url})",
                         hint="check the id on the hub; a private or gated model needs HF_TOKEN set where the API "
                              "and the workers run")
    if r.status_code >= 400:
        return Problem(field=field, message=f"the hub could not confirm model {value!r} (HTTP {r.status_code} "
                                              f"from {url})", hint="retry, or give a local model folder")
    return None


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def _cached_config_folder(repo_id: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an id the cache layout cannot hold: nothing cached
        return None
    return Path(found).parent if isinstance(found, str) else None


def _context_problems(cfg: RunConfig, folder: Path) -> list[Problem]:
    context = model_context(folder)
    if context is None:
        return []
    asked = cfg.max_prompt_tokens + cfg.max_response_tokens
    problems = []
    if asked > context:
        problems.append(Problem(
            field="max_response_tokens",
            message=f"max_prompt_tokens + max_response_tokens = {cfg.max_prompt_tokens} + {cfg.max_response_tokens} "
                    f"= {asked} exceeds the model's context of {context} tokens",
            hint=f"lower them so they add up to at most {context}"))
    for name in ("max_trajectory_tokens", "max_context_tokens"):
        if (value := getattr(cfg, name)) is not None and value > context:
            problems.append(Problem(field=name, message=f"{value} exceeds the model's context of {context} tokens",
                                    hint=f"set it to at most {context}"))
    return problems


def model_context(folder: Path) -> int | None:
    """The context length config.json states (None when there is no config or it names none)."""
    try:
        config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    for key in CONTEXT_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return None


def _lora_problems(cfg: RunConfig, folder: Path) -> list[Problem]:
    """Each LoRA target module must end the path of a module of the model with a 2-d weight (a linear layer or
    an embedding: what LoRA adapts), matched as PEFT matches names."""
    lora = cfg.algorithm.lora
    if lora is None or lora.target_modules == "all-linear":
        return []
    modules = weight_modules(folder)
    if not modules:
        return []  # no safetensors header to read: the trainer reports it
    missing = [t for t in lora.target_modules if not any(m == t or m.endswith("." + t) for m in modules)]
    if not missing:
        return []
    names = sorted({m.rsplit(".", 1)[-1] for m in modules})
    return [Problem(field="algorithm.lora.target_modules",
                      message=f"the model has no module named {', '.join(map(repr, missing))}",
                      hint=f"choose among its adaptable modules: {', '.join(names)}; or use \"all-linear\"")]


def weight_modules(folder: Path) -> set[str]:
    """Paths of the modules with a 2-d `weight` in the model's safetensors files (read from the headers only)."""
    modules = set()
    for path in folder.glob("*.safetensors"):
        try:
            with open(path, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        except (OSError, ValueError):
            continue
        modules |= {name.removesuffix(".weight") for name, info in header.items()
                    if name.endswith(".weight") and isinstance(info, dict) and len(info.get("shape", ())) == 2}
    return modules


# ---- engines ----------------------------------------------------------------------------------------------


def live_engines(redis_client: SyncRedis) -> list[set[str]] | None:
    """The engine sets live rollout workers advertise (None when Redis cannot be asked)."""
    try:
        workers = live_workers(redis_client, "rollout-worker")
    except RedisError:
        return None
    return [set(w.engines) for w in workers if w.engines is not None]


def _engine_problems(redis_client: SyncRedis, cfg: RunConfig) -> list[Problem]:
    offered = live_engines(redis_client)
    if not offered or any(cfg.engine.type in engines for engines in offered):
        return []
    available = sorted(set().union(*offered))
    return [Problem(field="engine.type",
                      message=f"no live rollout worker offers engine {cfg.engine.type!r} "
                              f"({len(offered)} worker(s) offer: {', '.join(available) or 'none'})",
                      hint=f"choose one of {', '.join(available)}, or start a rollout worker that has "
                           f"{cfg.engine.type!r} installed (vllm: the GPU image / the vllm extra)")]


# ---- dataset rows -----------------------------------------------------------------------------------------


def required_fields(cfg: RunConfig) -> list[tuple[str, ...]]:
    """Fields each dataset row must have for a built-in env (alternatives per entry), less what env.args gives."""
    if cfg.env.name not in REGISTRIES["env"]:
        return []  # user envs say what they need when they build; they are not run in the API
    needed = getattr(resolve("env", cfg.env.name), "required_fields", ())
    return [tuple(alts) for alts in needed if not set(alts) & set(cfg.env.args)]


def _row_problems(engine: Engine, cfg: RunConfig) -> list[Problem]:
    problems = []
    for alternatives in required_fields(cfg):
        with engine.connect() as conn:
            rows = conn.execute(
                select(DatasetRow.task_id).join(Dataset, Dataset.id == DatasetRow.dataset_id)
                .where(Dataset.name == cfg.dataset, Dataset.split == cfg.dataset_split,
                       Dataset.version == cfg.dataset_version, ~DatasetRow.data.has_any(array(alternatives)))
                .order_by(DatasetRow.idx).limit(3)).scalars().all()
        if rows:
            names = " or ".join(repr(a) for a in alternatives)
            problems.append(Problem(
                field="dataset",
                message=f"env {cfg.env.name!r} needs a {names} field in every row; rows without it include task_id "
                        f"{', '.join(map(repr, rows))}",
                hint="add the field to the dataset and re-import it, or give it for every row in env.args"))
    return problems
