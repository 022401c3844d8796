"""`flywheel`: the command line over the REST API (FLYWHEEL_API_URL, else http://127.0.0.1:$API_PORT, default
port 8000, and FLYWHEEL_TOKEN). Examples:

    flywheel datasets import data/train.jsonl --name gsm8k-tiny
    flywheel runs start -f run.yaml --watch
    flywheel runs watch <run-id>
    flywheel eval -f eval.yaml            # progress bar, then the pass@k table
    flywheel trajectories list <run> --min-reward 1 --limit 5
    flywheel sql "SELECT * FROM reward_by_policy_version LIMIT 5"
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.api.schemas import ErrorBody

app = typer.Typer(help="flywheel: RL post-training for LLM agents", no_args_is_help=True)
runs_app = typer.Typer(help="start, list, watch and control runs", no_args_is_help=True)
datasets_app = typer.Typer(help="import and list datasets", no_args_is_help=True)
tokens_app = typer.Typer(help="API tokens", no_args_is_help=True)
trajectories_app = typer.Typer(help="list a run's trajectories and show one turn by turn", no_args_is_help=True)
app.add_typer(runs_app, name="runs")
app.add_typer(trajectories_app, name="trajectories")
app.add_typer(datasets_app, name="datasets")
app.add_typer(tokens_app, name="tokens")
# Long messages (paths, errors) stay on one line; piped output gets wide tables so ids are never cut.
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
TERMINAL = ("stopped", "completed", "failed")
UPLOADABLE = (".jsonl", ".json", ".csv", ".parquet")


# ---- talking to the API -------------------------------------------------------------------------------------


def api_url() -> str:
    """FLYWHEEL_API_URL, else the local API on API_PORT: the same variable `make up` starts the API with, so a
    stack on another port is followed without a second setting."""
    return os.environ.get("FLYWHEEL_API_URL") or f"http://127.0.0.1:{os.environ.get('API_PORT') or 8000}"


def client() -> httpx.Client:
    url = api_url()
    token = os.environ.get("FLYWHEEL_TOKEN") or os.environ.get("API_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=60)


def call(method: str, path: str, **kw) -> Any:
    """One API call; an error response ends the command with the API's explanation (each problem's field,
    message and hint)."""
    try:
        with client() as c:
            r = c.request(method, path, **kw)
    except httpx.HTTPError as e:
        _fail(f"cannot reach the API at {api_url()}: {e}; is `make up` running? Set FLYWHEEL_API_URL (or API_PORT) "
              f"to the URL it printed")
    if r.status_code >= 400:
        _fail(f"{r.status_code}: {_error_text(r)}")
    return r.json() if r.content else None


def _error_text(r: httpx.Response) -> str:
    try:
        body = ErrorBody.model_validate(r.json())
    except ValueError:
        return r.text[:2000]
    if len(body.detail) == 1 and not body.detail[0].hint:
        return body.message
    lines = [(f"{i.field}: " if i.field else "") + i.message + (f"\n    hint: {i.hint}" if i.hint else "")
             for i in body.detail]
    return "\n  " + "\n  ".join(lines)


def _fail(message: str) -> None:
    console.print(f"[red]error[/red] {message}")
    raise typer.Exit(1)


def _load_yaml(path: Path) -> dict:
    if not path.exists():
        _fail(f"{path}: no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        _fail(f"{path}: not valid YAML ({e})")
    if not isinstance(data, dict):
        _fail(f"{path}: expected a mapping of run config fields")
    return data


def _typed(raw: str) -> Any:
    """A --set value as the type it reads as: JSON scalars (3, 1e-5, true, null, "quoted"), YAML/JSON lists and
    mappings ([1, 2], {type: vllm}); anything else is the string itself (model=Qwen/Qwen2.5-0.5B, name=no)."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    if raw.strip()[:1] in ("[", "{"):
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError as e:
            _fail(f"--set value {raw!r} is not a valid list or mapping ({e})")
    return raw


def apply_overrides(config: dict, overrides: list[str]) -> dict:
    """`--set key=value` over a run config: dotted keys reach nested fields (algorithm.lr=1e-5), typed values."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            _fail(f"--set {item!r}: expected KEY=VALUE with a dotted KEY, e.g. --set total_steps=20 "
                  f"--set algorithm.lr=1e-5")
        node = config
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                _fail(f"--set {item!r}: {'.'.join(parts[:i + 1])} is {node!r}, not a mapping of fields")
        node[parts[-1]] = _typed(raw)
    return config


RunRef = Annotated[str, typer.Argument(help="the run's id, a unique prefix of its id, or its name")]
SET_HELP = "override a config field: KEY=VALUE, dotted keys for nested fields (algorithm.lr=1e-5); repeatable"


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*["" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in r])
    console.print(table)


# ---- runs ---------------------------------------------------------------------------------------------------


@runs_app.command("start")
def runs_start(file: Annotated[Path, typer.Option("-f", "--file", help="run config YAML")],
               watch: Annotated[bool, typer.Option(help="follow the run until it ends")] = False,
               set_: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None) -> None:
    """Start a run from a YAML run config (the body of POST /v1/runs), e.g.
    `flywheel runs start -f examples/train_recall_grpo.yaml --set total_steps=20 --set algorithm.lr=1e-3`."""
    run = call("POST", "/v1/runs", json=apply_overrides(_load_yaml(file), set_ or []))
    console.print(f"started {run['kind']} run [bold]{run['name']}[/bold] id={run['id']}")
    if watch:
        runs_watch(run["id"])


@runs_app.command("list")
def runs_list(status: Annotated[str | None, typer.Option(help="only runs with this status")] = None,
              limit: int = 50) -> None:
    params = {"limit": limit} | ({"status": status} if status else {})
    page = call("GET", "/v1/runs", params=params)
    _table(f"runs ({page['count']})", ["id", "name", "kind", "status", "version", "created"],
           [[r["id"], r["name"], r["kind"], r["status"], r["policy_version"], r["created_at"][:19]]
            for r in page["data"]])


@runs_app.command("show")
def runs_show(run_id: RunRef) -> None:
    run = call("GET", f"/v1/runs/{run_id}")
    console.print(f"[bold]{run['name']}[/bold] ({run['kind']}) status={run['status']} "
                  f"policy_version={run['policy_version']}")
    if run["error"]:
        console.print(f"[red]error[/red] {run['error']}")
    _print_attention(run)
    console.print(f"progress {_progress_text(run['progress'])}")
    units, attempts = run["ledger"]["units"], run["ledger"]["attempts"]
    requeued = run["ledger"].get("requeued", 0)
    console.print("samples " + _counts(units) + (f" ({requeued} requeued: scored on a re-run)" if requeued else "")
                  + "\nattempts " + _counts(attempts))
    _reasons_table(run["ledger"].get("top_reasons") or [])
    _table("latest metrics", ["metric", "step", "value"],
           [[k, v["step"], v["value"]] for k, v in sorted(run["latest_metrics"].items())])
    if run.get("pass_at_k"):
        _pass_at_k_table(run["pass_at_k"], run["ledger"])
    _mismatch_table(run_id)


def _print_attention(run: dict) -> None:
    """A stalled run's reason (and since when), and a warning such as groups without learning signal."""
    if run.get("stall_reason"):
        since = f" (since {run['stalled_since'][:19]})" if run.get("stalled_since") else ""
        console.print(f"[yellow]stalled[/yellow]{since} {run['stall_reason']}")
    if run.get("warning"):
        console.print(f"[yellow]warning[/yellow] {run['warning']}")


def _reasons_table(reasons: list[dict]) -> None:
    if reasons:
        _table("why units ended unscored (errored: the user's code; failed/lost: infrastructure; units re-run "
               "and then scored are not here)",
               ["outcome", "units", "attempts", "reason"],
               [[r["outcome"], r["units"], r["attempts"], r["reason"]] for r in reasons])


MISMATCH_METRICS = ("logprob_diff_mean", "logprob_diff_max", "is_truncated_fraction")


def _mismatch_table(run_id: str, last: int = 10) -> None:
    """Training-inference mismatch of the last `last` steps: |rollout logprob - trainer logprob| over the tokens
    that the weights a step started from generated (step s starts from version s - 1 and makes version s), and
    the share of IS weights truncated (the trainer's metrics, recorded under the step)."""
    series = call("GET", f"/v1/runs/{run_id}/metrics", params={"name": list(MISMATCH_METRICS)})["series"]
    by_version: dict[int, dict[str, float]] = {}
    for name, points in series.items():
        for p in points:
            by_version.setdefault(p["step"], {})[name] = p["value"]
    if by_version:
        _table("training-inference mismatch per step (step s measures version s-1, the weights it started from)",
               ["step", "mean |dlogp|", "max |dlogp|", "IS truncated"],
               [[v, *(by_version[v].get(m) for m in MISMATCH_METRICS)] for v in sorted(by_version)[-last:]])


def _progress_text(p: dict) -> str:
    return f"{p['done']}/{p['total'] if p['total'] is not None else '?'} {p['unit']}"


def _counts(c: dict[str, int]) -> str:
    """"total 10 = completed 8 + failed 1 + ..." (the parts add up to the total)."""
    parts = [f"{k.replace('_', ' ')} {v}" for k, v in c.items() if k != "total" and (v or k == "completed")]
    return f"{c['total']} = " + " + ".join(parts)


def _pass_at_k_table(pass_at_k: dict[str, float], ledger: dict | None = None) -> None:
    """pass@k is over the scored samples; the errored ones (the user's code failed) are counted beside it."""
    title = "pass@k"
    if ledger:
        units = ledger["units"]
        title += f" over {units['completed']} scored samples ({units.get('errored', 0)} errored, {units['failed']} failed)"
    _table(title, ["k", "pass@k"], [[k.removeprefix("pass@"), v] for k, v in pass_at_k.items()])


@runs_app.command("watch")
def runs_watch(run_id: RunRef, interval_s: Annotated[float, typer.Option(help="poll period, seconds")] = 1.0) -> None:
    """Live progress bar and mean reward per policy version until the run ends; when the output is not a
    terminal, one progress line per change instead (so logs and pipes see it as it happens)."""
    run_id = call("GET", f"/v1/runs/{run_id}")["id"]  # a name or id prefix, resolved once
    run = _follow(run_id, interval_s)
    console.print(f"run {run['name']} ended: {run['status']}" + (f": {run['error']}" if run["error"] else ""))
    if run.get("pass_at_k"):
        _pass_at_k_table(run["pass_at_k"], run["ledger"])
    _reasons_table(run["ledger"].get("top_reasons") or [])
    if run["status"] == "failed":
        raise typer.Exit(1)


def _follow(run_id: str, interval_s: float) -> dict:
    printed: set[int] = set()
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    last_line, last_stall = "", None
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task("progress", total=None)
        while True:
            run = call("GET", f"/v1/runs/{run_id}")
            p = run["progress"]
            bar.update(task, completed=p["done"], total=p["total"],
                       description=f"{run['status']} v{run['policy_version']} {p['unit']}")
            units = run["ledger"]["units"]
            line = f"{run['status']} v{run['policy_version']}: {_progress_text(p)}, errored samples " \
                   f"{units.get('errored', 0)}, failed samples {units['failed']}"
            if run.get("stall_reason"):
                line += f"; stalled: {run['stall_reason']}"
            if run.get("warning"):
                line += f"; warning: {run['warning']}"
            if not console.is_terminal and line != last_line:  # no live bar: print what changed
                console.print(line)
                last_line = line
            if console.is_terminal and run.get("stall_reason") != last_stall and run.get("stall_reason"):
                bar.console.print(f"stalled: {run['stall_reason']}")
            last_stall = run.get("stall_reason")
            for r in call("GET", f"/v1/runs/{run_id}/rewards")["data"]:
                v = r["policy_version"]
                if v is not None and v not in printed and (v < run["policy_version"] or run["status"] in TERMINAL):
                    printed.add(v)  # a version is printed once its trajectories are complete
                    bar.console.print(f"policy v{v}: mean reward {r['mean_reward']:.4f} "
                                      f"pass rate {r['pass_rate']:.3f} over {r['num_trajectories']} trajectories")
            if run["status"] in TERMINAL:
                return run
            time.sleep(interval_s)


def _control(run_id: str, action: str) -> None:
    run = call("POST", f"/v1/runs/{run_id}/{action}")
    console.print(f"run {run['name']} is now {run['status']}")


@runs_app.command("stop")
def runs_stop(run_id: RunRef) -> None:
    _control(run_id, "stop")


@runs_app.command("pause")
def runs_pause(run_id: RunRef) -> None:
    _control(run_id, "pause")


@runs_app.command("resume")
def runs_resume(run_id: RunRef) -> None:
    _control(run_id, "resume")


# ---- trajectories -------------------------------------------------------------------------------------------


@trajectories_app.command("list")
def trajectories_list(
    run_id: RunRef,
    policy_version: Annotated[int | None, typer.Option(help="generated (partly) by this policy version")] = None,
    min_reward: Annotated[float | None, typer.Option(help="reward at least this")] = None,
    max_reward: Annotated[float | None, typer.Option(help="reward at most this")] = None,
    termination_reason: Annotated[str | None, typer.Option(help="e.g. env_done, max_steps, response_truncation")] = None,
    task_id: Annotated[str | None, typer.Option(help="only this dataset task")] = None,
    limit: Annotated[int, typer.Option(help="rows per page")] = 20,
    offset: Annotated[int, typer.Option(help="rows to skip (the next page: --offset LIMIT)")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="the page as JSON")] = False,
) -> None:
    """A run's trajectories, newest first, with GET /v1/runs/{run}/trajectories' filters and paging."""
    params = {"policy_version": policy_version, "min_reward": min_reward, "max_reward": max_reward,
              "termination_reason": termination_reason, "task_id": task_id, "limit": limit, "offset": offset}
    page = call("GET", f"/v1/runs/{run_id}/trajectories", params={k: v for k, v in params.items() if v is not None})
    if as_json:
        typer.echo(json.dumps(page))
        return
    rows = page["data"]
    shown = f"{offset + 1}-{offset + len(rows)} of {page['count']}" if rows else f"none of {page['count']}"
    _table(f"trajectories ({shown})", ["id", "task", "sample", "attempt", "reward", "ended", "steps", "tokens",
                                        "versions", "created"],
           [[t["id"], t["task_id"], t["sample_idx"], t["attempt"], t["reward"], t["termination_reason"],
             t["num_steps"], t["response_tokens"], _versions(t["policy_version_min"], t["policy_version_max"]),
             t["created_at"][:19]] for t in rows])
    if offset + len(rows) < page["count"]:
        console.print(f"next page: --offset {offset + len(rows)}")


def _versions(lo: int | None, hi: int | None) -> str:
    return "" if lo is None else str(lo) if lo == hi else f"{lo}-{hi}"


@trajectories_app.command("show")
def trajectories_show(
    trajectory_id: Annotated[str, typer.Argument(help="the trajectory's id (from `flywheel trajectories list`)")],
    tokens: Annotated[bool, typer.Option(help="with token ids and logprobs (large)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="the whole record as JSON")] = False,
) -> None:
    """One trajectory turn by turn: each step's messages, action, reward; the episode's task and outcome."""
    t = call("GET", f"/v1/trajectories/{trajectory_id}", params={"include_tokens": tokens})
    if as_json:
        typer.echo(json.dumps(t))
        return
    ep = t.get("episode") or {}
    console.print(f"[bold]trajectory {t['id']}[/bold] run={t['run_id']} task={t['task_id']} "
                  f"sample={t['sample_idx']} attempt={t['attempt']} versions="
                  f"{_versions(t['policy_version_min'], t['policy_version_max'])}")
    console.print(f"reward {t['reward']:.4g}, ended by {t['termination_reason']}, {t['num_steps']} steps, "
                  f"{t['prompt_tokens']} prompt + {t['response_tokens']} response tokens")
    if ep:
        console.print(f"task {json.dumps(ep.get('task'))}", markup=False)
        if ep.get("error"):
            console.print(f"[red]error[/red] {ep['error']}")
    for s in t["steps"]:
        console.print(f"[bold]step {s['step_idx']}[/bold] reward {s['reward']:.4g}"
                      + (" (done)" if s["done"] else "") + (f" v{s['weight_version']}" if s["weight_version"]
                                                          is not None else ""))
        for m in s["chat_completions"]:
            console.print(f"  {m.get('role', '?')}: {m.get('content')}", markup=False)
        if s["action"] is not None:
            console.print(f"  action: {json.dumps(s['action'])}", markup=False)
    for a in t.get("tokens") or []:
        console.print(f"tokens step {a['step_idx']}: prompt {a['prompt_ids']} response {a['response_ids']} "
                      f"logprobs {a['logprobs']}", markup=False)


# ---- evaluation ---------------------------------------------------------------------------------------------


@app.command("eval")
def evaluate(
    file: Annotated[Path, typer.Option("-f", "--file", help="run config YAML (kind is set to eval)")],
    checkpoint_run: Annotated[str | None, typer.Option(
        help="evaluate this run's checkpoint instead of `model` (its id, id prefix or name)")] = None,
    version: Annotated[int | None, typer.Option(help="checkpoint version (default: latest)")] = None,
    wait: Annotated[bool, typer.Option(help="follow the run and print pass@k")] = True,
    interval_s: float = 1.0,
    set_: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None,
) -> None:
    """Evaluate a model or checkpoint on a dataset: progress bar, then the pass@k table."""
    config = apply_overrides(_load_yaml(file), set_ or []) | {"kind": "eval"}
    if checkpoint_run:
        job = call("POST", "/v1/evals", json={"config": config, "checkpoint_run_id": checkpoint_run,
                                              "checkpoint_version": version})
        run_id = _wait_job(job["id"])["result"]["run_id"]
    else:
        run_id = call("POST", "/v1/runs", json=config)["id"]
    console.print(f"eval run id={run_id}")
    if wait:
        runs_watch(run_id, interval_s)


def _wait_job(job_id: str, timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = call("GET", f"/v1/jobs/{job_id}")
        if job["status"] == "succeeded":
            return job
        if job["status"] == "failed":
            _fail(f"job {job_id} ({job['kind']}) failed: {job['error']}")
        time.sleep(0.5)
    _fail(f"job {job_id} did not finish within {timeout_s:.0f}s; see `GET /v1/jobs/{job_id}`")


# ---- datasets, tokens, SQL, local stack ---------------------------------------------------------------------


@datasets_app.command("import")
def datasets_import(
    source: Annotated[str, typer.Argument(help="a local .jsonl/.csv/.parquet file, a HF datasets folder on the "
                                               "API's machine, or a built-in generator with --generator")],
    name: Annotated[str, typer.Option(help="dataset name")],
    split: str = "train",
    generator: Annotated[bool, typer.Option(help="SOURCE names a built-in generator")] = False,
    n: Annotated[int, typer.Option(help="generator: rows")] = 100,
    seed: int = 0,
) -> None:
    """Upload a file, or import a server-side folder / generator as a background job."""
    path = Path(source)
    if not generator and path.is_file() and path.suffix.lower() in UPLOADABLE:
        with path.open("rb") as f:
            ds = call("POST", "/v1/datasets", data={"name": name, "split": split}, files={"file": (path.name, f)})
        if "kind" in ds:  # 202: the jobs worker, which stores it, has not finished yet
            ds = _wait_job(ds["id"])["result"]
    else:
        body = {"name": name, "split": split} | (
            {"generator": source, "n": n, "seed": seed} if generator else {"path": str(path.resolve())})
        ds = _wait_job(call("POST", "/v1/datasets/import", json=body)["id"])["result"]
    console.print(f"dataset {ds['name']}/{ds['split']}: {ds['num_rows']} rows")


@datasets_app.command("list")
def datasets_list() -> None:
    items = call("GET", "/v1/datasets")["data"]
    _table("datasets", ["name", "split", "rows", "source", "created"],
           [[d["name"], d["split"], d["num_rows"], d["source"], (d["created_at"] or "")[:19]] for d in items])


@tokens_app.command("create")
def tokens_create(name: str, scope: Annotated[list[str] | None, typer.Option(help="read, write or admin")] = None) -> None:
    """Create a token (needs an admin token); the token is printed once and only its hash is stored."""
    t = call("POST", "/v1/tokens", json={"name": name, "scopes": scope or ["read"]})
    console.print(f"token for {t['name']} (scopes {', '.join(t['scopes'])}); store it now, it is not shown again:")
    typer.echo(t["token"])


@app.command("sql")
def sql(query: str, max_rows: int = 1000, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Run one read-only SQL statement (as the flywheel_reader role, with a statement timeout)."""
    out = call("POST", "/v1/sql", json={"query": query, "max_rows": max_rows})
    if as_json:
        typer.echo(json.dumps([dict(zip(out["columns"], r, strict=True)) for r in out["rows"]]))
        return
    _table("" if not out["truncated"] else f"first {len(out['rows'])} rows", out["columns"], out["rows"])


@app.command("up", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def up(ctx: typer.Context) -> None:
    """Start every service as local processes (infra.local.stack; options pass through, see `flywheel-stack
    --help`); embedded Redis/Postgres when REDIS_URL/DATABASE_URL are unset."""
    try:
        from infra.local.stack import main as stack_main
    except ImportError as e:
        _fail(f"the local stack is not available ({e}); use `docker compose up`")
    sys.argv = ["flywheel-stack", *ctx.args]  # the stack parses its own options
    stack_main()


if __name__ == "__main__":
    app()
