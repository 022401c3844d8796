"""The dashboard in a real headless browser (Debian's chromium driven by Playwright) against a live API with
stored runs: the runs list loads, the run page's charts (uPlot, vendored) render with data, clicking a
trajectory opens the turn-by-turn viewer. Screenshots go to tests/browser/artifacts/ (gitignored).

CI needs: `apt-get install -y chromium` and `pip install playwright` (never `playwright install`).

    pytest -q -m browser tests/browser/test_dashboard.py
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from api_testlib import running_api, seed_run  # noqa: E402

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
    ARTIFACTS.mkdir(exist_ok=True)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    page.goto(f"{api.url}/ui/?token={api.token}")
    page.wait_for_selector("#runs tr.link")
    assert "browser-run" in page.inner_text("#runs")

    page.click(f"tr[data-href='#/runs/{run_id}']")
    page.wait_for_selector("#chart-reward[data-points]")
    for key in ("reward", "pass", "kl", "entropy", "throughput", "time"):
        assert int(page.get_attribute(f"#chart-{key}", "data-points")) >= 3, key
    ledger = page.inner_text("#ledger")
    assert "samples completed" in ledger and "18" in ledger and "in flight" in ledger
    assert page.evaluate("typeof uPlot") == "function"  # the vendored library, served by the API itself
    assert page.locator(".charts .uplot").count() == 6  # one uPlot chart per panel
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
    page.screenshot(path=str(ARTIFACTS / "trajectory.png"), full_page=True)
    assert errors == []
