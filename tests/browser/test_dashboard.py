"""The dashboard in a real headless browser (Debian's chromium driven by Playwright) against a live API with
stored runs, asserting what a user must see: the runs list; a training run's charts (uPlot, vendored) with
reward and pass-rate axes in 0-1, distinct tick labels on flat series, legends inside their panels; the
trajectory table paged and filtered by the API; a finished evaluation's pass@k and reward charts with data (no
"no data yet"); a stalled run's reason, warning and errored units; the turn-by-turn viewer. Screenshots of each
page go to tests/browser/artifacts/ (gitignored; .ci/run lists them for the CI job to keep), so a reviewer can
look at what the assertions saw.

CI needs: `apt-get install -y chromium` and `pip install playwright` (never `playwright install`).

    pytest -q -m browser tests/browser/test_dashboard.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from api_testlib import running_api, seed_run
from sqlalchemy import create_engine, update
from sqlalchemy import text as sql
from sqlalchemy.orm import Session

from shared.contracts.db.models import Metric

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts"
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (apt-get install chromium)"),
]


@pytest.fixture(scope="module")
def api(database_url, redis_url, tmp_path_factory):
    with running_api(database_url, redis_url, tmp_path_factory.mktemp("api-browser")) as live:
        yield live


@pytest.fixture(scope="module")
def page():
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        yield page
        browser.close()


def test_runs_run_page_charts_and_trajectory_viewer(api, page, database_url):
    run_id = seed_run(database_url, name="browser-run", num_tasks=3, samples=2, versions=3)
    engine = create_engine(database_url)
    with engine.begin() as conn:  # timings and a trace id as a rollout worker with tracing on stores them
        conn.execute(sql("UPDATE rollout_tasks SET dispatched_at = now() - interval '3 s' WHERE run_id = :r"),
                     {"r": run_id})
        conn.execute(sql("UPDATE episodes SET started_at = now() - interval '2 s', finished_at = now() - "
                         "interval '1 s', info = info || jsonb_build_object('trace_id', CAST(:t AS text)) "
                         "WHERE run_id = :r"),
                     {"r": run_id, "t": "4bf92f3577b34da6a3ce929d0e0e4736"})
    engine.dispose()
    ARTIFACTS.mkdir(exist_ok=True)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    page.goto(f"{api.url}/ui/?token={api.token}")
    page.wait_for_selector("#runs tr.link")
    assert "browser-run" in page.inner_text("#runs")

    page.click(f"tr[data-href='#/runs/{run_id}']")
    page.wait_for_selector("#chart-reward[data-points]")
    for key in ("reward", "pass", "kl", "entropy", "throughput", "mismatch", "truncated", "time", "iscorr",
                "offpolicy", "async", "stale"):
        assert int(page.get_attribute(f"#chart-{key}", "data-points")) >= 3, key
    ledger = page.inner_text("#ledger")
    assert "samples scored" in ledger and "18" in ledger and "in flight" in ledger
    assert "malformed tool calls" in page.inner_text("#tool-call-errors")  # the seeded wrong answers' calls
    assert page.evaluate("typeof uPlot") == "function"  # the vendored library, served by the API itself
    assert page.locator(".charts .uplot").count() == 12  # one uPlot chart per panel
    # verl's names, each set on a panel of its own (the KL panel keeps the trainer's own KLs)
    assert "rollout_corr/k3_kl" in page.inner_text("#chart-offpolicy .u-legend")
    assert "rollout_corr" not in page.inner_text("#chart-kl .u-legend")
    assert "fully_async/rollouter/idle_ratio" in page.inner_text("#chart-async .u-legend")
    assert "logprob_diff_max" in page.inner_text("#chart-mismatch .u-legend")
    legend = page.inner_text("#chart-reward .u-legend")
    assert "mean reward (trajectories)" in legend and "reward_mean" in legend
    painted = page.evaluate("""() => { const c = document.querySelector('#chart-reward canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }""")
    assert painted > 500  # the chart's canvas really has ink on it
    page.screenshot(path=str(ARTIFACTS / "run_page.png"), full_page=True)

    page.click("#trajectories tr.link >> nth=0")
    page.wait_for_selector("#trajectory-title")
    text = page.inner_text("main")
    assert "turn 0" in text and "turn 1" in text and "user" in text and "assistant" in text
    assert "termination" in text and "policy version" in text
    # the unit's timeline: queue wait, the rollout under two turns of generation and env step, the store; and
    # its trace id; a legend names each colour with its time
    assert page.locator("#timeline .seg").count() == 7
    legend = page.inner_text("#timeline-legend")
    assert all(k in legend for k in ("queue", "generation 10 ms", "env 2 ms", "worker (reset, agent, tokenizer)",
                                     "store"))
    assert page.locator("#timeline-legend .swatch").count() == 5
    note = page.inner_text("#timeline-note")
    assert "queue" in note and "generation 10 ms" in note and "env 2 ms" in note and "trace 4bf92f3577b34da6a3ce929d0e0e4736" in note
    page.screenshot(path=str(ARTIFACTS / "trajectory.png"), full_page=True)
    assert errors == []


def _flatten(database_url: str, run_id, values: dict[str, float]) -> None:
    """Make these metric series flat (one value at every step), as a run that does not move them has."""
    engine = create_engine(database_url)
    with Session(engine) as s:
        for name, value in values.items():
            s.execute(update(Metric).where(Metric.run_id == run_id, Metric.name == name).values(value=value))
        s.commit()
    engine.dispose()


def _y(page, chart: str) -> tuple[list[float], list[str]]:
    """(y range, y tick labels) of a chart, as lineChart records them."""
    page.wait_for_function(f"() => document.querySelector('#chart-{chart}').dataset.yTicks")
    lo_hi = page.get_attribute(f"#chart-{chart}", "data-y-range")
    return [float(v) for v in lo_hi.split(",")], page.get_attribute(f"#chart-{chart}", "data-y-ticks").split("|")


def test_axes_legends_and_paging_of_a_training_run(api, page, database_url):
    run_id = seed_run(database_url, name="browser-paging", num_tasks=10, samples=3, versions=3, status="completed")
    _flatten(database_url, run_id, {"ppo_kl": 0.0, "kl_behaviour": 0.0, "entropy": 6.231})
    ARTIFACTS.mkdir(exist_ok=True)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{api.url}/ui/?token={api.token}#/runs/{run_id}")
    page.wait_for_selector("#traj-range")

    for chart in ("reward", "pass", "time"):  # 0-1 quantities with every value in 0-1: the axis runs 0-1
        assert _y(page, chart)[0] == [0.0, 1.0], chart
    assert _y(page, "pass")[1] == ["0.00", "0.25", "0.50", "0.75", "1.00"]
    for chart in ("kl", "entropy"):  # flat series: a band around the value, every tick label different
        (lo, hi), ticks = _y(page, chart)
        labels = [t for t in ticks if t]
        assert lo < hi and len(labels) >= 3 and len(set(labels)) == len(labels), (chart, ticks)
    assert _y(page, "kl")[0] == [0.0, 1.0] and _y(page, "entropy")[0][0] < 6.231 < _y(page, "entropy")[0][1]
    for chart in ("reward", "pass", "kl"):  # every legend entry inside its panel, none cut off
        clipped = page.evaluate(f"""() => {{ const box = document.querySelector('#chart-{chart}').closest('.chart')
            .getBoundingClientRect(); return [...document.querySelectorAll('#chart-{chart} .u-legend .u-series')]
            .filter(e => {{ const r = e.getBoundingClientRect(); return r.right > box.right + 1 || r.bottom > box.bottom + 1; }})
            .map(e => e.innerText); }}""")
        assert clipped == [], (chart, clipped)
    assert "no data yet" not in page.inner_text("main")

    # 90 trajectories: pages of 50, newest first, through the API's paging
    assert page.inner_text("#traj-count") == "90" and page.inner_text("#traj-range") == "1–50 of 90"
    assert page.locator("#trajectories tbody tr.link").count() == 50
    page.screenshot(path=str(ARTIFACTS / "training_run.png"), full_page=True)
    page.click("#traj-next")
    page.wait_for_function("() => document.querySelector('#traj-range')?.innerText === '51–90 of 90'")
    assert page.locator("#trajectories tbody tr.link").count() == 40
    page.click("#traj-prev")
    page.wait_for_function("() => document.querySelector('#traj-range')?.innerText === '1–50 of 90'")

    page.fill("#traj-filter input[name=task_id]", "task-1")  # a filter: one task's 3 samples x 3 versions
    page.click("#traj-filter button")
    page.wait_for_function("() => document.querySelector('#traj-range')?.innerText === '1–9 of 9'")
    assert page.locator("#trajectories tbody tr.link td:first-child").all_inner_texts() == ["task-1"] * 9
    page.select_option("#traj-filter select[name=termination_reason]", "max_steps")  # and one ending of it
    page.click("#traj-filter button")
    page.wait_for_function("() => document.querySelector('#traj-range')?.innerText === '1–3 of 3'")
    tasks = page.locator("#trajectories tbody tr.link td:first-child").all_inner_texts()
    reasons = page.locator("#trajectories tbody tr.link td:nth-child(4)").all_inner_texts()
    assert tasks == ["task-1"] * 3 and set(reasons) == {"max_steps"}
    assert page.input_value("#traj-filter input[name=task_id]") == "task-1"  # the form shows the filter in force
    page.screenshot(path=str(ARTIFACTS / "trajectories_filtered.png"), full_page=True)
    page.fill("#traj-filter input[name=min_reward]", "2")
    page.click("#traj-filter button")
    page.wait_for_function("() => document.querySelector('#traj-count')?.innerText === '0'")
    assert "no trajectories match these filters" in page.inner_text("#trajectories")
    assert errors == []


def test_a_finished_evaluation_shows_its_data(api, page, database_url):
    run_id = seed_run(database_url, name="browser-eval", kind="eval", status="completed", num_tasks=4, samples=4,
                      versions=1)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{api.url}/ui/?token={api.token}#/runs")
    page.wait_for_selector("#runs tr.link")
    assert "browser-eval" in page.inner_text("#runs") and "browser-paging" in page.inner_text("#runs")
    page.screenshot(path=str(ARTIFACTS / "runs_list.png"), full_page=True)

    page.click(f"tr[data-href='#/runs/{run_id}']")
    page.wait_for_selector("#traj-range")
    page.wait_for_function("() => document.querySelector('#chart-passk').dataset.yTicks")
    text = page.inner_text("main")
    assert "no data yet" not in text and "not recorded" not in text, text
    assert page.locator(".charts .uplot").count() == 1  # pass@k: no training-only panels waiting for data
    assert int(page.get_attribute("#chart-passk", "data-points")) == 3  # pass@1, pass@2, pass@4
    assert _y(page, "passk")[0] == [0.0, 1.0]
    assert "pass@1" in page.inner_text("#ledger")
    assert page.inner_text("#eval-mean-reward") == page.inner_text("#eval-pass-rate") == "0.5"  # 8 of 16 right
    page.screenshot(path=str(ARTIFACTS / "eval_run.png"), full_page=True)
    assert errors == []


def test_a_stalled_run_shows_why_its_warning_and_its_errored_units(api, page, database_url):
    """What a user must never miss on a run's page: why it is stalled, a warning (no learning signal), and units
    whose own code failed counted apart from scored ones, with the top reason."""
    from datetime import UTC, datetime

    from shared.contracts.db.models import RolloutTaskRow, Run

    run_id = seed_run(database_url, name="browser-stalled", status="running", num_tasks=3, samples=2, versions=2)
    reason = "env my_pkg:MyEnv.reset: KeyError: 'answer'"
    engine = create_engine(database_url)
    with Session(engine) as s:
        s.execute(update(Run).where(Run.id == run_id).values(
            stall_reason="no env worker alive (start one: python -m services.env_worker.main)",
            stalled_since=datetime.now(UTC), warning="no learning signal: in each of the last 3 policy versions"))
        s.add_all([RolloutTaskRow(run_id=run_id, task_id=f"err-{i}", sample_idx=0, attempt=0, status="error",
                                  error=reason) for i in range(2)])
        s.commit()
    engine.dispose()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{api.url}/ui/?token={api.token}#/runs")
    page.wait_for_selector("#runs tr.link")
    assert "stalled: no env worker alive" in page.inner_text("#runs")
    page.click(f"tr[data-href='#/runs/{run_id}']")
    page.wait_for_selector("#run-stall")
    assert page.inner_text("#run-stall").startswith("stalled since ")
    assert "no env worker alive" in page.inner_text("#run-stall")
    assert page.inner_text("#run-warning").startswith("warning: no learning signal")
    assert "samples errored\n2" in page.inner_text("main")
    reasons = page.inner_text("#reasons")
    assert "error" in reasons and reason in reasons, reasons
    page.screenshot(path=str(ARTIFACTS / "stalled_run.png"), full_page=True)
    assert errors == []


def test_every_legend_entry_has_a_line_axes_say_what_they_measure_and_one_token_answers_show(api, page, database_url):
    """The items a user reported: legend entries without a visible line (kl_ref drawn under an identical
    kl_behaviour), a share and logprob differences on one axis, a throughput axis without a unit, "16-16" version
    ranges, a one-token answer missing from its trajectory, and a stopped run without data."""
    from shared.contracts.db.models import StepRecordRow, TrajectoryRow

    run_id = seed_run(database_url, name="browser-items", num_tasks=2, samples=1, versions=3, status="completed")
    _flatten(database_url, run_id, {"ppo_kl": 0.0, "kl_behaviour": 0.0})
    engine = create_engine(database_url)
    with Session(engine) as s:  # the recall task's shape: one token answered, the prompt alone in the messages
        traj = s.query(TrajectoryRow).filter_by(run_id=run_id, task_id="task-1", policy_version_min=2).first()
        traj.termination_reason, traj.reward, traj.num_steps = "response_truncation", 1.0, 1
        s.query(StepRecordRow).filter_by(trajectory_id=traj.id, step_idx=1).delete()
        s.query(StepRecordRow).filter_by(trajectory_id=traj.id, step_idx=0).update(
            {"chat_added": [{"role": "user", "content": "seven"}], "model_response": "7", "action": "7"})
        traj_id = traj.id
        s.commit()
    engine.dispose()
    stopped = seed_run(database_url, name="browser-stopped-empty", status="stopped", versions=0)
    ARTIFACTS.mkdir(exist_ok=True)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    page.goto(f"{api.url}/ui/?token={api.token}#/runs/{run_id}")
    page.wait_for_selector("#traj-range")
    page.wait_for_function("() => document.querySelector('#chart-kl').dataset.yTicks")
    assert page.get_attribute("#chart-kl", "data-legend") == "kl_behaviour = ppo_kl"  # one line, one entry
    assert page.locator("#chart-kl .u-legend .u-series").all_inner_texts() == ["kl_behaviour = ppo_kl"]
    assert page.get_attribute("#chart-mismatch", "data-legend") == "logprob_diff_max|logprob_diff_mean"
    assert page.get_attribute("#chart-truncated", "data-legend") == "is_truncated_fraction"
    assert _y(page, "truncated")[0] == [0.0, 1.0]  # a share on an axis of its own
    assert page.get_attribute("#chart-throughput", "data-y-label") == "tokens / s"  # the axis says its unit
    assert page.get_attribute("#chart-mismatch", "data-y-label") == "|Δ logprob| (nats)"
    versions = page.locator("#trajectories tbody tr.link td:nth-child(7)").all_inner_texts()
    assert versions and all("–" not in v for v in versions), versions  # "2", not "2–2"
    page.screenshot(path=str(ARTIFACTS / "charts_legends_units.png"), full_page=True)

    page.goto(f"{api.url}/ui/?token={api.token}#/trajectories/{traj_id}")
    page.wait_for_selector("#trajectory-title")
    turns = page.inner_text("main")
    assert "assistant\n7" in turns and "user\nseven" in turns, turns  # the one-token answer is shown
    assert page.inner_text("#trajectory-versions") == "2"
    assert page.inner_text("#termination-note") == "max_response_tokens reached"
    page.screenshot(path=str(ARTIFACTS / "one_token_trajectory.png"), full_page=True)

    page.goto(f"{api.url}/ui/?token={api.token}#/runs/{stopped}")
    page.wait_for_selector("#traj-range, #traj-count")
    page.wait_for_function("() => document.querySelector('#chart-reward')?.dataset.points === '0'")
    text = page.inner_text("main")
    assert "not recorded for this run" not in text and "no data: the run ended before any was recorded" in text
    assert "lease expired" not in text
    page.screenshot(path=str(ARTIFACTS / "stopped_run_without_data.png"), full_page=True)
    assert errors == []
