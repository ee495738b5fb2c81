"""The production simulator against a real vLLM server on the tiny bootstrapped policy:
`perpetua simulate --json` end to end (server start, drifting traffic, episodes, traces in the
landing zone that the trace contract accepts), with the failure rate per family in its output.
Unit checks of the drift mix and the report run without an engine, and those of a run that meets
a failed version reading or a refit on a scripted one."""

from __future__ import annotations

import json
import os
import socket

from ops.tasks import task_world

from ops.harvest import contract as traces
from ops.common.paths import Home
from ops.harvest.simulator import Traffic, failure_rates
from scripted_engine import ScriptedEngine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_traffic_drifts_with_production_time():
    traffic = Traffic(seed=3)
    early = [traffic.task_at(0.0).family for _ in range(300)]
    late = [traffic.task_at(1.0).family for _ in range(300)]
    assert "mod" not in early and "sub_words" not in early and "add_words" in early
    assert {"mod", "mul_words", "sub_words"} <= set(late)
    drift_share = lambda fams: sum(task_world.FAMILIES[f].kind == "drift" for f in fams) / len(fams)
    assert drift_share(late) > drift_share(early) + 0.2


def test_failure_rates_by_window():
    def rec(family, outcome):
        return traces.TraceRecord(trace_id=f"{family}-{outcome}-{id(object())}", timestamp="2025-01-01T00:00:00Z", model_version="1",
                                  family=family, question="q", messages=[], outcome=outcome)

    records = [rec("add", "success"), rec("add", "failure"), rec("mod", "failure"), rec("mod", "error")]
    rows, by_family = failure_rates(records, [0.1, 0.2, 0.9, 1.0], windows=2)
    assert {(r["window"], r["family"]): r["rate"] for r in rows} == {(0, "add"): 0.5, (1, "mod"): 1.0}
    assert by_family["mod"] == {"kind": "drift", "requests": 2, "failures": 2, "rate": 1.0}


def test_simulate_command_against_real_server(perpetua_home, base_policy_dir, capsys, monkeypatch):
    from ops.common import tracking
    from ops.serving import vllm_server
    from pipelines.cli import main

    port = _free_port()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = tracking.local_store(perpetua_home / "mlflow")[0]  # where --traces mlflow goes in a home without a server
    try:
        code = main(["simulate", "--model-dir", str(base_policy_dir), "--requests", "48", "--wave-size", "16",
                     "--port", str(port), "--json"])  # fmt: skip
        out = capsys.readouterr().out
        # the running server's ZeroMQ sockets are in its own folder, not the shared temporary one
        sockets = vllm_server.ipc_dir(Home(perpetua_home), port)
        assert any(p.is_socket() for p in sockets.iterdir()), sorted(sockets.iterdir())
        to_mlflow = main(["simulate", "--model-dir", str(base_policy_dir), "--requests", "12", "--wave-size", "6",
                          "--port", str(port), "--json", "--traces", "mlflow", "--seed", "5", "--stop-server"])  # fmt: skip
        mlflow_out = json.loads(capsys.readouterr().out)
    finally:
        vllm_server.stop(port)
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the tracer's process-wide URI was borrowed, then given back
    # With --traces mlflow the same episodes are MLflow traces in the project's experiment, each
    # read back by the contract's MLflow mapping; failures carry the production check's verdict.
    assert to_mlflow == 0 and mlflow_out["traces_to"] == "mlflow:perpetua" and mlflow_out["landing_files"] == []
    c = tracking.client(uri)
    logged = c.search_traces(locations=[c.get_experiment_by_name("perpetua").experiment_id], max_results=100)
    assert len(logged) == 12
    back = [traces.validate_record(traces.record_from_mlflow_trace(t)) for t in logged]
    assert all(isinstance(r, traces.TraceRecord) for r in back), back
    for r, t in zip(back, logged):
        negative = [a for a in t.info.assessments if a.name == traces.MLFLOW_FEEDBACK_NAME]
        assert (r.outcome == "failure") == bool(negative) and r.model_version == "0" and r.usage.completion_tokens > 0
        assert (r.outcome == "success") == (r.final_answer == r.task.answer)
    assert sum(mlflow_out["outcomes"].values()) == 12
    assert code == 0
    result = json.loads(out)
    assert result["requests"] == 48 and sum(result["outcomes"].values()) == 48
    assert result["model_version"] == "0" and result["policy_version"] == 0
    # Every landing record fits the trace contract, one file per wave.
    landing = perpetua_home / "landing"
    files = sorted(landing.glob("simulator-*.jsonl"))
    assert len(files) == 3 and [str(f) for f in files] == sorted(result["landing_files"])
    records = [traces.validate_json_line(line) for f in files for line in f.read_text().splitlines()]
    assert all(isinstance(r, traces.TraceRecord) for r in records), [r for r in records if isinstance(r, str)]
    assert len({r.trace_id for r in records}) == 48
    for r in records:
        assert r.outcome in ("success", "failure", "error") and r.usage.completion_tokens > 0
        assert (r.outcome == "success") == (r.final_answer == r.task.answer)
        assert r.messages[0].role == "user" and len(r.tool_calls) == sum(m.role == "tool" for m in r.messages)
    assert any(r.tool_calls for r in records)
    # The drift shows in the report: drift families only where the mix has them.
    rates = result["failure_rate"]
    assert all(0.0 <= row["rate"] <= 1.0 for row in rates)
    assert not [row for row in rates if row["family"] == "mod" and row["t_end"] <= task_world.FAMILIES["mod"].appears_at]
    drift = {f: v for f, v in result["by_family"].items() if v["kind"] == "drift"}
    boot = {f: v for f, v in result["by_family"].items() if v["kind"] == "bootstrap"}
    assert drift and boot and sum(v["requests"] for v in result["by_family"].values()) == 48
    print("\nfailure rate by family:", {f: (v["rate"], v["requests"]) for f, v in result["by_family"].items()})
    print("drift families by window:", [(r["window"], r["family"], r["rate"]) for r in rates if r["kind"] == "drift"])
    assert not vllm_server.pid_file(Home(perpetua_home), port).exists()
    assert not sockets.exists()  # `--stop-server` removed them with the server


def test_simulate_without_a_champion_is_a_clear_error(perpetua_home, capsys):
    from pipelines.cli import main

    assert main(["simulate", "--port", str(_free_port())]) == 2
    assert "no champion to serve" in capsys.readouterr().err


class _GlitchingEngine(ScriptedEngine):
    """A scripted engine (it answers "ANSWER 0") whose version reading fails (reads None) at the
    given readings, or whose served version becomes `refit_to` from a reading on: a loaded
    machine's dropped /weight_info answer, or a deploy that refits the server mid-run."""

    def __init__(self, tokenizer, none_at=(), refit_at=None, refit_to=4):
        super().__init__(tokenizer, lambda prompt, r: "ANSWER 0\n", version=3)
        self.none_at, self.refit_at, self.refit_to, self.reads = set(none_at), refit_at, refit_to, 0

    @property
    def policy_version(self):
        self.reads += 1
        if self.refit_at is not None and self.reads >= self.refit_at:
            return self.refit_to
        return None if self.reads in self.none_at else self.version


def _tokenizer(tmp_path):
    from ops.policy import tokenizer as tok_lib

    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(512), tmp_path / "tok")
    return tok_lib.load_hf_tokenizer(tmp_path / "tok")


def test_a_failed_version_reading_does_not_end_the_traffic_and_a_refit_does(tmp_path):
    from ops.harvest.simulator import SimulatorConfig, run_simulation

    tok = _tokenizer(tmp_path)
    cfg = SimulatorConfig(requests=40, wave_size=8, seed=5)
    # The 4th reading fails (inside the second wave): the wave is sent again, every request lands.
    lines = []
    glitch = run_simulation(_GlitchingEngine(tok, none_at={4}), tok, tmp_path / "a", cfg, log=lines.append)
    assert len(glitch.records) == 40 and glitch.stopped_early is None
    assert any("sending the wave again" in line for line in lines)
    assert sum(len(p.read_text().splitlines()) for p in glitch.landing_files) == 40
    # The same traffic, no glitch: the same tasks in the same order.
    clean = run_simulation(_GlitchingEngine(tok), tok, tmp_path / "b", cfg)
    assert [r.question for r in clean.records] == [r.question for r in glitch.records]
    # A refit mid-run: the run stops after the waves the old version served, and says why.
    refit = run_simulation(_GlitchingEngine(tok, refit_at=6), tok, tmp_path / "c", cfg)
    assert 0 < len(refit.records) < 40 and "the served policy changed" in refit.stopped_early
