"""Run commands applied (create, pause, resume, stop; complete and fail for tinker runs;
shared/contracts/messages/control.py), each in one
transaction under the run's row lock, idempotent by command id. The command loop (command_loop.py) reads them
from `run.commands` and answers the sender.

More: docs/architecture.md#run-commands-and-run-control
"""

from __future__ import annotations

from pydantic import ValidationError
from sqlalchemy import Connection, Engine, func, insert, select

from services.controller.run_rows import add_event, set_status
from shared.clients.run_commands import command_applied
from shared.contracts.db.models import Run
from shared.contracts.messages import RunCommand, RunCommandReply
from shared.contracts.messages.control import TINKER_ENDS, TRANSITIONS
from shared.contracts.run_config import RunConfig
from shared.contracts.tinker_run import TinkerRunConfig


def apply_command(db: Engine, cmd: RunCommand, expired: bool) -> RunCommandReply:
    """One run command in one transaction, under the run's row lock (shared/contracts/messages/control.py). Idempotent by
    command id (shared/clients/run_commands.py command_applied): one applied before (a redelivery) is answered `applied` again
    and changes nothing; one not yet applied and `expired` is not applied."""
    with db.begin() as conn:
        status, kind = conn.execute(select(Run.status, Run.kind).where(Run.id == cmd.run_id).with_for_update()).first() \
            or (None, None)
        if status is not None and command_applied(conn, cmd):
            return _reply(cmd, "applied", status)
        if status is None and cmd.action != "create":
            return _reply(cmd, "not_found", None, f"run {cmd.run_id} does not exist")
        if expired:
            return _reply(cmd, "expired", status, "read after its sender stopped waiting; not applied")
        if cmd.action == "create":
            return create_run(conn, cmd)
        if kind == "tinker":  # not driven: nothing to drain on its end, and only its client pauses its work
            if cmd.action not in TINKER_ENDS:
                return _reply(cmd, "refused", status, f"a tinker run cannot {cmd.action}: its Tinker client drives it")
            allowed, new = TRANSITIONS["stop"][0], TINKER_ENDS[cmd.action]
        elif cmd.action not in TRANSITIONS:
            return _reply(cmd, "refused", status, f"a {kind} run cannot be told to {cmd.action}: it completes or "
                                                  "fails by itself; stop it to end it now")
        else:
            allowed, new = TRANSITIONS[cmd.action]
        if status not in allowed:
            return _reply(cmd, "refused", status, f"cannot {cmd.action} a run that is {status}; {cmd.action} "
                                                  f"needs status {' or '.join(allowed)}")
        set_status(conn, cmd.run_id, status, new, error=cmd.reason if cmd.action == "fail" else None,
                   because={"command": cmd.command_id, "action": cmd.action})
        version = conn.execute(select(Run.status_version).where(Run.id == cmd.run_id)).scalar()
        return _reply(cmd, "applied", new).model_copy(update={"status_version": version})


def create_run(conn: Connection, cmd: RunCommand) -> RunCommandReply:
    """The run of a `create` command, `pending`, with its `created` event; refused when its config is not a
    valid run config (the sender checked it; this guards against a producer that did not). A Tinker run
    (shared/contracts/tinker_run.py) is stored `running`: its client is already at work."""
    if (cmd.config or {}).get("kind") == "tinker":
        return _create_tinker_run(conn, cmd)
    try:
        cfg = RunConfig.model_validate(cmd.config or {})
    except ValidationError as e:
        return _reply(cmd, "refused", None, f"not a valid run config: {e}")
    conn.execute(insert(Run).values(id=cmd.run_id, name=cfg.name, kind=cfg.kind, status="pending",
                                    config=cfg.model_dump(mode="json"), policy_version=0, summary={}))
    by = f" by {cmd.created_by}" if cmd.created_by else ""
    add_event(conn, cmd.run_id, "created", f"{cfg.kind} run created{by}",
              {"rows": cmd.rows, "command": cmd.command_id})
    return _reply(cmd, "applied", "pending")


def _create_tinker_run(conn: Connection, cmd: RunCommand) -> RunCommandReply:
    try:
        cfg = TinkerRunConfig.model_validate(cmd.config)
    except ValidationError as e:
        return _reply(cmd, "refused", None, f"not a valid tinker run config: {e}")
    conn.execute(insert(Run).values(id=cmd.run_id, name=cfg.name, kind="tinker", status="running",
                                    started_at=func.now(), config=cfg.model_dump(mode="json"), policy_version=0,
                                    summary={}))
    by = f" by {cmd.created_by}" if cmd.created_by else ""
    add_event(conn, cmd.run_id, "created", f"tinker run created{by}", {"command": cmd.command_id})
    return _reply(cmd, "applied", "running")


def _reply(cmd: RunCommand, outcome: str, status: str | None, message: str = "") -> RunCommandReply:
    return RunCommandReply(command_id=cmd.command_id, outcome=outcome, status=status, message=message)
