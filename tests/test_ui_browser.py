"""The real Dagster and MLflow UIs over the project's code location and store, driven by a real browser.

A temporary PERPETUA_HOME gets one harvest (production_traces observed, harvested_failures
materialized through the `harvest` job); `dagster-webserver -w workspace.yaml` serves it on a
free port on 127.0.0.1; Playwright drives Debian's Chromium (/usr/bin/chromium; no browser
download) through the global asset lineage, the automation list, the retraining sensor and the
materialization, and asserts what a user would read there. The project's MLflow server, holding
production traces as the demo logs them, harvested and one marked fixed, is checked the same way:
the Traces view with the loop's assessments, and one trace with its spans and the harvester's
rationale. Screenshots go to tmp_path; set
PERPETUA_UI_SHOTS=DIR to keep a copy for a look (e.g. to refresh docs/ui/).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
LOCATION = "pipelines.definitions"
pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed (pip install -e '.[test]')")  # the code location name workspace.yaml gives the module

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (make setup installs it as root)"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"dagster-webserver exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/server_info", timeout=2) as r:
                if r.status == 200 and "dagster_version" in json.loads(r.read()):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"dagster-webserver did not answer /server_info within {timeout}s:\n{log.read_text()[-3000:]}")


def graphql(url: str, query: str) -> dict:
    req = urllib.request.Request(url + "/graphql", data=json.dumps({"query": query}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (webserver and its code server), SIGKILL what stays."""
    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.25)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@pytest.fixture
def harvested(perpetua_home, monkeypatch):
    """One harvest of a small landing zone in the project's instance; returns its result."""
    import dagster as dg
    from test_harvest import rec  # module-level helper: one production trace record

    from ops.harvest.contract import write_traces
    from pipelines.commands.harvest import run_harvest

    dagster_home = perpetua_home / "dagster"
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    write_traces([rec(i, "failure" if i % 3 else "success") for i in range(12)], perpetua_home / "landing")
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        return run_harvest({"known_model_versions": ["1", "2"]}, instance=instance)


@pytest.fixture
def webserver(harvested, perpetua_home, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "webserver.log"
    env = {**os.environ, "PERPETUA_HOME": str(perpetua_home), "DAGSTER_HOME": str(perpetua_home / "dagster")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("dagster-webserver")), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_until_up(url, proc, log)
        # The community sign-up dialog covers the first page on 127.0.0.1; mark it seen, as its Skip button does.
        assert graphql(url, "mutation { setNuxSeen }")["data"]["setNuxSeen"] is True
        yield url
    finally:
        stop(proc)


@contextmanager
def browser_page():
    """A page of Debian's Chromium, 1920x1080, 30 s default timeout; closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1920, "height": 1080}).new_page()
            page.set_default_timeout(30_000)
            yield page
        finally:
            browser.close()


def check_and_keep(shots: Path) -> None:
    """Every screenshot is a real rendering, not an empty page; PERPETUA_UI_SHOTS=DIR keeps copies."""
    keep = os.environ.get("PERPETUA_UI_SHOTS")
    for png in shots.glob("*.png"):
        assert png.stat().st_size > 10_000, png
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy2(png, Path(keep) / png.name)


def expand_all_groups(page) -> None:
    """Click every collapsed asset group in the lineage graph; the reload re-fits the view."""
    page.locator("foreignObject").first.wait_for()
    collapsed = page.locator("[class*=CollapsedGroupNode_collapsedGroupNodeBox]")
    for _ in range(3):
        if collapsed.count() == 0:
            return
        while collapsed.count():
            collapsed.first.click()
            page.wait_for_timeout(300)
        page.reload()
        page.wait_for_load_state("networkidle")
        page.locator("foreignObject").first.wait_for()
        page.wait_for_timeout(800)


def test_dagster_ui_shows_the_graph_the_sensor_and_a_materialization(webserver, harvested, tmp_path):
    from playwright.sync_api import expect

    from pipelines.definitions import defs

    graph = defs.resolve_asset_graph()
    asset_names = sorted(k.to_user_string() for k in graph.get_all_asset_keys())
    groups = sorted({graph.get(k).group_name for k in graph.get_all_asset_keys()})
    sensors = sorted(s.name for s in defs.sensors or [])
    schedules = sorted(s.name for s in defs.schedules or [])
    assert "retraining_sensor" in sensors and "harvested_failures" in asset_names
    counts = {k: harvested[k] for k in ("read", "harvested", "duplicates", "successes_skipped", "quarantined")}
    conservation = " + ".join(f"{k} {v}" for k, v in counts.items() if k != "read")
    conservation = f"read {counts['read']} = {conservation}"
    shots = tmp_path / "ui"
    shots.mkdir()

    with browser_page() as page:
        # Global asset lineage: every group, and every asset once the groups are expanded.
        page.goto(webserver + "/asset-groups")
        page.wait_for_load_state("networkidle")
        expect(page.get_by_text("Global asset lineage")).to_be_visible()
        expand_all_groups(page)
        for name in asset_names:
            expect(page.locator("foreignObject").get_by_text(name, exact=True).first).to_be_visible()
        for group in groups:
            expect(page.locator("foreignObject").get_by_text(group, exact=True).first).to_be_visible()
        page.screenshot(path=str(shots / "lineage.png"))

        # Automation: every sensor and schedule of the code location.
        page.goto(webserver + "/automation")
        page.wait_for_load_state("networkidle")
        for name in sensors + schedules:
            expect(page.get_by_text(name, exact=True).first).to_be_visible()
        page.screenshot(path=str(shots / "automation.png"))

        # The retraining sensor's own page: its description names the job it starts.
        sensor = next(s for s in defs.sensors if s.name == "retraining_sensor")
        page.goto(f"{webserver}/locations/{LOCATION}/sensors/retraining_sensor")
        expect(page.get_by_text("retraining_sensor").first).to_be_visible()
        expect(page.get_by_text(sensor.description).first).to_be_visible()
        page.screenshot(path=str(shots / "sensor.png"))

        # The materialization: its metadata as the harvest reported it, and the run it came from.
        page.goto(webserver + "/assets/harvested_failures?view=events")
        expect(page.get_by_text(conservation).first).to_be_visible()
        expect(page.get_by_text(f"Materialized in run {harvested['dagster_run_id'][:8]}").first).to_be_visible()
        expect(page.get_by_text(harvested["failures_table"]).first).to_be_visible()
        page.screenshot(path=str(shots / "materialization.png"), full_page=True)

    check_and_keep(shots)


@pytest.fixture
def mlflow_traffic(perpetua_home):
    """The project's MLflow server on a free port, holding production traces as the demo logs
    them, harvested once (so the harvester's verdicts are on them) and one marked fixed."""
    from datetime import datetime, timezone

    from test_mlflow_traces import _episode_records

    from ops.common.paths import home
    from ops.harvest import verdicts
    from ops.harvest.harvester import HarvestConfig, harvest
    from ops.harvest.mlflow_sink import MlflowTraceSink, TraceLogger
    from ops.harvest.mlflow_source import MlflowTraceSource
    from ops.serving import mlflow_server

    h = home()
    server = mlflow_server.start(h, port=free_port())
    try:
        records = TraceLogger(MlflowTraceSink(tracking_uri=server.url)).log(_episode_records(), started=datetime.now(timezone.utc))
        result = harvest(HarvestConfig(known_model_versions=frozenset({"1"}),
                                       mlflow=MlflowTraceSource(tracking_uri=server.url, experiment_names=["perpetua"])))
        links = {"dagster.run_id": "ui-test"}
        verdicts.mark_harvested(server.url, result.mlflow_failures, result.generation, links)
        fixed = result.mlflow_failures[0]
        verdicts.mark_fixed(server.url, "perpetua", [fixed["task_id"]], "2", links, "solves it on the harvested slice")
        yield server.url, records, result, _evaluation(server.url)
    finally:
        mlflow_server.stop(h)


def _evaluation(uri: str) -> dict:
    """A cycle's eval as eval_report logs it: the eval sets as datasets, an evaluation run per policy."""
    from test_eval_datasets import DAGSTER, _policy

    from ops.common import tracking
    from ops.evaluate import mlflow_datasets as ed
    from ops.tasks import task_world
    from ops.tasks.training_tasks import eval_tasks

    sets = {"deciding": eval_tasks(task_world.DRIFT_FAMILIES[:2], 4), "guard": eval_tasks(task_world.BOOTSTRAP_FAMILIES[:1], 3)}
    parent = tracking.start_cycle_run(uri, "perpetua", cycle=3, tags=DAGSTER)
    with tracking.stage_run(uri, parent, "evaluate", tags=DAGSTER) as stage:
        models = {"candidate": stage.log_checkpoint("policy-v2", step=3), "champion": None}
        datasets = ed.ensure_datasets(uri, stage.experiment_id, sets, DAGSTER)
        evals = {"candidate": _policy(2, sets, lambda t: True),
                 "champion": _policy(1, sets, lambda t: t.family == task_world.DRIFT_FAMILIES[0])}
        runs = {role: ed.log_evaluation_run(uri, ed.EvalRunSpec(role, 3, stage.run_id, models[role], DAGSTER), ev, datasets, sets)
                for role, ev in evals.items()}
    return {"experiment": stage.experiment_id, "datasets": datasets, "runs": runs}


def test_mlflow_ui_shows_production_traces_with_the_loop_verdicts(mlflow_traffic, tmp_path):
    from playwright.sync_api import expect

    from ops.common import tracking

    from ops.evaluate import mlflow_datasets as ed

    url, records, result, evaluation = mlflow_traffic
    experiment = tracking.client(url).get_experiment_by_name("perpetua").experiment_id
    shots = tmp_path / "ui"
    shots.mkdir()
    with browser_page() as page:
        # The Traces view: every production episode, its question, and the assessments.
        page.goto(tracking.traces_url(url, experiment))
        expect(page.get_by_text(records[0].question, exact=False).first).to_be_visible(timeout=60_000)
        for hint in ("Got it", "Close"):  # first-visit hint and the assistant panel cover the columns
            button = page.get_by_role("button", name=hint, exact=True)
            if button.count():
                button.first.click()
        for r in records:
            expect(page.get_by_text(r.question, exact=False).first).to_be_visible()
        for text in ("perpetua_harvested", "perpetua_fixed_by", "user_feedback", "wrong_answer", "tool_error",
                     "error:engine_error"):
            expect(page.get_by_text(text, exact=True).first).to_be_visible()
        page.screenshot(path=str(shots / "mlflow-traces.png"))
        # One harvested trace opened: its spans, and the harvester's verdict with its rationale.
        wrong = next(r for r in records if r.final_answer == "0")
        page.get_by_text(wrong.question, exact=False).first.click()
        for span in ("agent", "policy", "calc"):
            expect(page.get_by_text(span, exact=True).first).to_be_visible()
        page.get_by_role("button", name="Assess").first.click()
        panel = page.get_by_role("dialog")
        expect(panel.get_by_text("Feedback (3)", exact=True)).to_be_visible()
        for name in ("perpetua_harvested", "perpetua_fixed_by", "user_feedback"):
            expect(panel.get_by_text(name, exact=True).first).to_be_visible()
        verdict = panel.get_by_text("wrong_answer", exact=True).first.locator("xpath=ancestor::*[.//button][1]")
        verdict.locator("button").first.click()  # the chevron unfolds the verdict: source and rationale
        expect(panel.get_by_text("perpetua.harvester", exact=True).first).to_be_visible()
        expect(panel.get_by_text("harvested as a wrong_answer failure", exact=False).first).to_be_visible()
        page.screenshot(path=str(shots / "mlflow-trace.png"))

        # The eval sets as evaluation datasets, and candidate vs champion as evaluation runs on them.
        page.goto(tracking.experiment_page_url(url, experiment, "datasets"))
        for d in evaluation["datasets"].values():
            expect(page.get_by_text(d.name, exact=True).first).to_be_visible(timeout=60_000)
        page.screenshot(path=str(shots / "mlflow-datasets.png"))
        page.goto(tracking.experiment_page_url(url, experiment, "evaluation-runs"))
        for name in ("cycle-3/candidate-v2", "cycle-3/champion-v1", "deciding.pass_at_1"):
            expect(page.get_by_text(name, exact=True).first).to_be_visible(timeout=60_000)
        page.screenshot(path=str(shots / "mlflow-evaluation-runs.png"))
        runs = evaluation["runs"]  # the link eval_report's materialization carries: candidate compared to champion
        page.goto(ed.evaluation_runs_url(url, evaluation["experiment"], runs["candidate"], runs["champion"]))
        page.reload()  # a hash change within the same view keeps the old selection
        expect(page.get_by_text("Comparing", exact=False).first).to_be_visible(timeout=60_000)
        for name in ("cycle-3/candidate-v2", "cycle-3/champion-v1"):
            expect(page.get_by_text(name, exact=True).first).to_be_visible()
    check_and_keep(shots)
