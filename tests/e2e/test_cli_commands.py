"""The `flywheel` CLI end to end (typer.testing.CliRunner) against a live API process and a real jobs worker.

    pytest -q tests/e2e/test_cli_commands.py
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest
import yaml
from api_testlib import run_config, seed_run, start_api
from sqlalchemy import create_engine, update
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from services.api.cli import app
from shared.contracts.db.models import RolloutTaskRow, Run

runner = CliRunner()
MATH_ROWS = '{"id": 1, "question": "1+1?", "answer": "2"}\n{"id": 2, "question": "2+2?", "answer": "4"}\n'


@pytest.fixture(scope="module")
def api(database_url, redis_url, tmp_path_factory):
    data = tmp_path_factory.mktemp("cli")
    live = start_api(database_url, redis_url, data, jobs=True)
    yield live
    live.stop()


@pytest.fixture
def cli(api, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_API_URL", api.url)
    monkeypatch.setenv("FLYWHEEL_TOKEN", api.token)

    def invoke(*args: str, ok: bool = True):
        result = runner.invoke(app, list(args), catch_exceptions=False)
        assert (result.exit_code == 0) == ok, result.output
        return result.output

    return invoke


def test_datasets_import_and_list(cli, tmp_path):
    (tmp_path / "cli.jsonl").write_text("\n".join(json.dumps({"id": i, "q": str(i)}) for i in range(4)))
    assert "cli-ds/train: 4 rows" in cli("datasets", "import", str(tmp_path / "cli.jsonl"), "--name", "cli-ds")
    out = cli("datasets", "import", "arithmetic", "--generator", "--n", "6", "--name", "cli-gen")
    assert "cli-gen/train: 6 rows" in out
    listed = cli("datasets", "list")
    assert "cli-ds" in listed and "cli-gen" in listed
    assert "no such file" in cli("datasets", "import", str(tmp_path / "missing"), "--name", "x", ok=False)


def test_runs_start_list_show_control(cli, tmp_path, database_url):
    (tmp_path / "d.jsonl").write_text(MATH_ROWS)
    cli("datasets", "import", str(tmp_path / "d.jsonl"), "--name", "cli-runs")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run_config("cli-runs", name="cli-run")))
    out = cli("runs", "start", "-f", str(tmp_path / "run.yaml"))
    run_id = out.split("id=")[1].split()[0]
    assert run_id in cli("runs", "list", "--status", "pending")
    assert "status=pending" in cli("runs", "show", run_id)
    assert "cannot pause a run that is pending" in cli("runs", "pause", run_id, ok=False)
    assert "now stopping" in cli("runs", "stop", run_id)
    live = seed_run(database_url, name="cli-live")
    assert "now paused" in cli("runs", "pause", str(live))
    assert "now running" in cli("runs", "resume", str(live))
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(run_config("nope", name="bad")))
    assert "dataset" in cli("runs", "start", "-f", str(tmp_path / "bad.yaml"), ok=False)
    (tmp_path / "nomodel.yaml").write_text(yaml.safe_dump(run_config("cli-runs", model=".data/models/nope-x")))
    out = cli("runs", "start", "-f", str(tmp_path / "nomodel.yaml"), ok=False)
    assert "400" in out and "model: '.data/models/nope-x' is neither" in out and "hint: " in out  # readable


def test_runs_watch_until_the_run_ends(cli, database_url):
    run_id = seed_run(database_url, name="cli-watch", kind="eval", status="running", versions=2)

    def complete_later():
        time.sleep(1.5)
        engine = create_engine(database_url)
        with Session(engine) as s:
            s.execute(update(Run).where(Run.id == run_id).values(status="completed"))
            s.commit()
        engine.dispose()

    threading.Thread(target=complete_later).start()
    out = cli("runs", "watch", str(run_id), "--interval-s", "0.3")
    assert "policy v0: mean reward" in out and "policy v1: mean reward" in out
    assert "ended: completed" in out and "pass@k" in out
    # not a terminal: progress is printed as lines while the run goes, before it ends
    assert out.index("running v1: 16/") < out.index("ended: completed")


def test_runs_show_prints_the_training_inference_mismatch_per_step(cli, database_url):
    run_id = seed_run(database_url, name="cli-mismatch", versions=3)
    out = cli("runs", "show", str(run_id))
    title = "training-inference mismatch per step (step s measures version s-1, the weights it started from)"
    assert title in out
    rows = [line.replace("│", " ").split() for line in out[out.index(title):].splitlines()]
    assert ["2", "0.003", "0.03", "0.1"] in rows and ["0", "0.001", "0.01", "0"] in rows  # step, mean, max, share


def test_failed_run_shows_its_error(cli, database_url):
    run_id = seed_run(database_url, name="cli-failed", kind="eval", status="running", versions=1)
    engine = create_engine(database_url)
    with Session(engine) as s:
        s.execute(update(Run).where(Run.id == run_id).values(
            status="failed", error="every attempt failed: model folder does not exist"))
        s.commit()
    engine.dispose()
    assert "error every attempt failed: model folder does not exist" in cli("runs", "show", str(run_id))
    out = cli("runs", "watch", str(run_id), ok=False)
    assert "ended: failed: every attempt failed" in out


def test_runs_show_and_watch_print_why_a_run_is_stalled_and_its_warning(cli, database_url):
    run_id = seed_run(database_url, name="cli-stalled", status="running", versions=2)
    engine = create_engine(database_url)
    with Session(engine) as s:
        s.execute(update(Run).where(Run.id == run_id).values(
            stall_reason="no env worker alive", warning="no learning signal: in each of the last 3 versions"))
        s.commit()
    out = cli("runs", "show", str(run_id))
    assert "stalled no env worker alive" in out and "warning no learning signal: in each of the last 3" in out
    with Session(engine) as s:  # ended, so `watch` prints its line once and returns
        s.execute(update(Run).where(Run.id == run_id).values(status="failed", error="gave up"))
        s.commit()
    engine.dispose()
    out = cli("runs", "watch", str(run_id), ok=False)
    assert "stalled: no env worker alive; warning: no learning signal" in out, out


def test_eval_of_a_checkpoint_prints_pass_at_k(cli, database_url, tmp_path):
    (tmp_path / "e.jsonl").write_text(MATH_ROWS)
    cli("datasets", "import", str(tmp_path / "e.jsonl"), "--name", "cli-eval")
    source = seed_run(database_url, name="cli-trained", status="completed")
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(run_config("cli-eval", name="cli-eval-run")))
    out = cli("eval", "-f", str(tmp_path / "eval.yaml"), "--checkpoint-run", str(source), "--no-wait")
    run_id = out.split("id=")[1].split()[0]
    assert "cli-eval-run@v2" in cli("runs", "show", run_id)


def test_tokens_and_sql(cli, api, monkeypatch, database_url):
    seed_run(database_url, name="cli-sql")
    out = cli("tokens", "create", "cli-reader", "--scope", "read")
    token = out.strip().splitlines()[-1]
    assert token.startswith("fw_")
    monkeypatch.setenv("FLYWHEEL_TOKEN", token)
    rows = json.loads(cli("sql", "SELECT run_name, count(*) AS n FROM trajectory_summary "
                                 "WHERE run_name = 'cli-sql' GROUP BY run_name", "--json"))
    assert rows == [{"run_name": "cli-sql", "n": 24}]
    assert "read-only transaction" in cli("sql", "DELETE FROM runs", ok=False)
    assert "403" in cli("runs", "stop", "00000000-0000-0000-0000-000000000000", ok=False)
    monkeypatch.setenv("FLYWHEEL_TOKEN", "wrong")
    assert "401" in cli("runs", "list", ok=False)


def test_runs_start_set_overrides_config_fields_with_typed_values(cli, api, tmp_path):
    (tmp_path / "d.jsonl").write_text(MATH_ROWS)
    cli("datasets", "import", str(tmp_path / "d.jsonl"), "--name", "cli-set")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run_config("cli-set", name="cli-set-run")))
    out = cli("runs", "start", "-f", str(tmp_path / "run.yaml"), "--set", "samples_per_task=3",
              "--set", "algorithm.lr=1e-5", "--set", "sampling.top_p=0.9", "--set", "name=cli-set-over",
              "--set", "env.args={max_turns: 2}")
    run_id = out.split("id=")[1].split()[0]
    config = httpx.get(f"{api.url}/v1/runs/{run_id}", headers={"Authorization": f"Bearer {api.token}"}).json()["config"]
    assert config["samples_per_task"] == 3 and config["algorithm"]["lr"] == 1e-5 and config["sampling"]["top_p"] == 0.9
    assert config["name"] == "cli-set-over" and config["env"] == {"name": "math", "args": {"max_turns": 2}}
    assert "expected KEY=VALUE" in cli("runs", "start", "-f", str(tmp_path / "run.yaml"), "--set", "lr", ok=False)
    out = cli("runs", "start", "-f", str(tmp_path / "run.yaml"), "--set", "name.first=x", ok=False)
    assert "name is 'cli-set-run', not a mapping" in out


def test_a_misspelt_field_or_dataset_names_the_closest_valid_one(cli, tmp_path):
    (tmp_path / "d.jsonl").write_text(MATH_ROWS)
    cli("datasets", "import", str(tmp_path / "d.jsonl"), "--name", "cli-spelling")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run_config("cli-spelling", samples_per_tsk=4)))
    out = cli("runs", "start", "-f", str(tmp_path / "run.yaml"), ok=False)
    assert "samples_per_tsk: unknown field" in out and "hint: did you mean 'samples_per_task'?" in out, out
    out = cli("runs", "start", "-f", str(tmp_path / "run.yaml"), "--set", "samples_per_tsk=null",
              "--set", "algorithm.lrr=0.1", ok=False)  # nested: the hint names the nested model's field
    assert "algorithm.lrr: unknown field" in out and "did you mean 'lr'?" in out, out
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(run_config("cli-speling")))
    out = cli("runs", "start", "-f", str(tmp_path / "typo.yaml"), ok=False)
    assert "no dataset named 'cli-speling'" in out and "did you mean 'cli-spelling'?" in out, out
    assert "cli-spelling/train" in out  # what exists is listed


def test_runs_are_addressed_by_name_or_unique_id_prefix(cli, database_url):
    named = seed_run(database_url, name="cli-by-name", versions=1)
    assert "cli-by-name (train)" in cli("runs", "show", "cli-by-name")
    assert "cli-by-name (train)" in cli("runs", "show", str(named)[:8])
    assert "now stopping" in cli("runs", "stop", str(named)[:13])  # dashes count as part of the prefix
    seed_run(database_url, name="cli-by-name", versions=1)
    out = cli("runs", "show", "cli-by-name", ok=False)
    assert "ambiguous: 2 runs are named 'cli-by-name'" in out and str(named) in out, out
    twins = [uuid.UUID("abcdef01-1000-4000-8000-000000000000"), uuid.UUID("abcdef01-2000-4000-8000-000000000000")]
    engine = create_engine(database_url)
    with Session(engine) as s:
        s.add_all(Run(id=i, name=f"cli-twin-{n}", kind="eval", status="completed", config=run_config("x"), summary={})
                  for n, i in enumerate(twins))
        s.commit()
    engine.dispose()
    out = cli("runs", "show", "abcdef01", ok=False)
    assert "ambiguous: 2 run ids start with 'abcdef01'" in out and all(str(i) in out for i in twins), out
    assert "cli-twin-1 (eval)" in cli("runs", "show", "ABCDEF01-2")  # case does not matter
    out = cli("runs", "show", "cli-by-nmae", ok=False)
    assert "404" in out and "did you mean 'cli-by-name'?" in out, out
    assert "404" in cli("runs", "show", str(uuid.uuid4()), ok=False)  # a full id is looked up as given


def test_trajectories_list_filters_and_pages_and_show_prints_the_turns(cli, database_url):
    run_id = seed_run(database_url, name="cli-trajs", num_tasks=4, samples=2, versions=3)  # 24 trajectories
    out = cli("trajectories", "list", "cli-trajs", "--limit", "5")
    assert "trajectories (1-5 of 24)" in out and "next page: --offset 5" in out
    page = json.loads(cli("trajectories", "list", "cli-trajs", "--json", "--policy-version", "1", "--min-reward", "1",
                          "--task-id", "task-1", "--limit", "50"))
    # version 1, task-1: samples 2 and 3; correct when (1 + k + 1) is even -> k = 0 only
    assert page["count"] == 1 and page["data"][0]["task_id"] == "task-1" and page["data"][0]["reward"] == 1.0
    ids = {t["id"] for t in json.loads(cli("trajectories", "list", str(run_id), "--json", "--limit", "20"))["data"]}
    rest = json.loads(cli("trajectories", "list", str(run_id), "--json", "--limit", "20", "--offset", "20"))["data"]
    assert len(ids) == 20 and len(rest) == 4 and not ids & {t["id"] for t in rest}  # pages do not overlap
    assert "none of 0" in cli("trajectories", "list", "cli-trajs", "--max-reward", "-1")
    assert "termination_reason" in cli("trajectories", "list", "cli-trajs", "--termination-reason", "nope", ok=False)

    shown = cli("trajectories", "show", page["data"][0]["id"])
    assert "task=task-1" in shown and "versions=1" in shown and "step 1 reward 1" in shown
    assert "assistant: step 1: the answer is \\boxed{2}" in shown and "user: What is 1+1?" in shown
    assert "prompt [1, 2, 3]" in cli("trajectories", "show", page["data"][0]["id"], "--tokens")
    assert "404" in cli("trajectories", "show", "00000000-0000-0000-0000-000000000000", ok=False)


def test_the_cli_follows_api_port_when_flywheel_api_url_is_unset(cli, api, monkeypatch):
    monkeypatch.delenv("FLYWHEEL_API_URL")
    monkeypatch.setenv("API_PORT", api.url.rsplit(":", 1)[1])
    assert "runs (" in cli("runs", "list")
    monkeypatch.setenv("API_PORT", "1")  # nothing listens there: the error says where it looked and what to set
    out = cli("runs", "list", ok=False)
    assert "cannot reach the API at http://127.0.0.1:1" in out and "FLYWHEEL_API_URL" in out
    monkeypatch.setenv("FLYWHEEL_API_URL", api.url)  # set, it wins over API_PORT
    assert "runs (" in cli("runs", "list")


def test_runs_show_counts_a_unit_scored_on_a_rerun_as_requeued_not_as_a_reason(cli, database_url):
    run_id = seed_run(database_url, name="cli-requeued", versions=1)
    engine = create_engine(database_url)
    with Session(engine) as s:  # task-0's sample 0 was lost once before its scored attempt (a loaded machine)
        s.add(RolloutTaskRow(run_id=run_id, task_id="task-0", sample_idx=0, attempt=1, status="lost", batch_idx=0,
                             dispatch_version=0, error="no result before the task lease expired"))
        s.commit()
    engine.dispose()
    out = cli("runs", "show", "cli-requeued")
    assert "(1 requeued: scored on a re-run)" in out and "lost 1" in out  # the attempt is still counted as such
    assert "why units ended unscored" not in out
