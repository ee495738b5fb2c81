"""The server backend against a real vLLM OpenAI-compatible server (started once, ~45-60 s):
supervision (start, reuse, stop), one group of tool episodes token-in/token-out with log-probs
checked against transformers, the stale-policy guard, one refit through the dev endpoints, and a
small `bench rollout` (the server path against raw API calls).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from ops.tasks import task_world
from ops.bench.rollout import perturbed_copy
from ops.policy import tokenizer as tok_lib
from ops.common.paths import Home
from ops.rollout.engine import EngineStartError, StalePolicyError
from ops.rollout.groups import SamplingConfig, generate_groups, rollouts_table
from ops.common.tables import ROLLOUTS
from ops.serving import vllm_server

TASKS = [t for fam in ("add", "sub", "mul_words") for t in task_world.generate_tasks(fam, 2, seed=21)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def max_logprob_diff(model_dir: Path, rows: list[dict]) -> float:
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            ref = logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)[len(r["prompt_ids"]) - 1 :]
            for lp, want, m in zip(r["behaviour_logprobs"], ref.tolist(), r["loss_mask"]):
                if m:
                    worst = max(worst, abs(lp - want))
    return worst


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Home:
    return Home(tmp_path_factory.mktemp("perpetua-home")).ensure()


@pytest.fixture(scope="module")
def server(home, base_policy_dir):
    from ops.rollout.vllm_engine import EngineConfig

    port = _free_port()
    info = vllm_server.start(base_policy_dir, EngineConfig(max_num_seqs=32), port=port, h=home)
    print(f"vLLM server healthy after {info.start_seconds:.1f} s")
    yield info
    vllm_server.stop(port, h=home)


@pytest.fixture(scope="module")
def engine(server, home):
    from ops.rollout.server import ServerEngine

    from ops.serving.api_key import api_key

    eng = ServerEngine([server.url], max_concurrency=16, api_key=api_key(home.root))
    yield eng
    eng.close()


def test_supervisor_reuses_a_healthy_server(server, home, base_policy_dir):
    again = vllm_server.start(base_policy_dir, port=server.port, h=home)
    assert again.reused and again.pid == server.pid
    assert vllm_server.status(server.port, h=home).pid == server.pid
    assert Path(server.log).is_file() and Path(server.log).parent == home.root / "services"
    with pytest.raises(vllm_server.VllmServerError, match="bind 127.0.0.1"):
        vllm_server.start(base_policy_dir, host="0.0.0.0", port=server.port + 1, h=home)
    with pytest.raises(vllm_server.VllmServerError, match="no config.json"):
        vllm_server.start(home.root, port=_free_port(), h=home)


def test_bench_rollout_compares_equal_work_on_one_server(server, home, base_policy_dir):
    """`bench rollout`, small, on this server (it leaves it serving the same weights and version):
    the ratio comes from the two measured sides, both sides did the same work (same tokens, same
    episodes, token for token), and each side reports its peak client and server RSS."""
    import statistics

    from ops.bench.rollout import run_bench
    from ops.serving.api_key import api_key

    result = run_bench(base_policy_dir, n_tasks=4, group_size=2, max_tokens=24, repeats=1, server=server,
                       api_key=api_key(home.root))
    base, cand = result["baseline"], result["candidate"]
    print({k: result[k] for k in ("ratio", "baseline", "candidate", "refit")})

    assert result["name"] == "rollout" and result["server"]["reused"]
    for side in (base, cand):
        assert side["tokens_per_s"] == round(statistics.median(t / s for t, s in zip(side["tokens"], side["seconds"])), 1)
        assert side["peak_client_rss_mb"] > 0 and side["peak_server_rss_mb"] > 0
    assert result["ratio"] == round(cand["tokens_per_s"] / base["tokens_per_s"], 4)

    assert base["episodes"] == cand["episodes"] == [4 * 2]
    assert base["tokens"] == cand["tokens"] and base["tokens"][0] > 0
    assert cand["episodes_identical_to_baseline"] == 1.0
    assert cand["mean_turns"] > 1, "the base policy calls the tool: the episodes are multi-turn"
    assert len(result["refit"]["seconds"]) == 2 and result["refit"]["bytes"] > 0


def test_group_through_server(engine, base_policy_dir):
    assert engine.policy_version == 0  # labelled from config.json at start
    tokenizer = tok_lib.load_hf_tokenizer(base_policy_dir)
    batch = generate_groups(engine, tokenizer, TASKS, SamplingConfig(group_size=4, seed=3), cycle=1, require_version=0)
    rows = batch.rows
    assert rollouts_table(rows).schema == ROLLOUTS and len(rows) == len(TASKS) * 4
    assert len({r["group_id"] for r in rows}) == len(TASKS)
    for r in rows:
        assert len(r["completion_ids"]) == len(r["behaviour_logprobs"]) == len(r["loss_mask"]) > 0
        assert r["policy_version"] == 0
    tool_rows = [r for r in rows if r["tool_calls"]]
    assert tool_rows, batch.finish_reasons
    for r in tool_rows:
        result = tokenizer.encode(task_world.tool_result_line(r["tool_calls"][0]), add_special_tokens=False)
        start = r["loss_mask"].index(0)
        assert r["completion_ids"][start : start + len(result)] == result
    assert max_logprob_diff(base_policy_dir, rows) < 1e-3


def test_importance_ratio_is_one_for_on_policy_rollouts_at_temperature_1_5(engine, base_policy_dir):
    from learner_data import learner_ratio_error

    tokenizer = tok_lib.load_hf_tokenizer(base_policy_dir)
    rows = generate_groups(engine, tokenizer, TASKS, SamplingConfig(group_size=2, seed=4, temperature=1.5),
                           cycle=1, require_version=0).rows
    assert learner_ratio_error(base_policy_dir, rows) < 1e-3
    assert learner_ratio_error(base_policy_dir, rows, temperature=1.0) > 0.05


def test_refit_through_dev_endpoints(engine, base_policy_dir, tmp_path_factory):
    tokenizer = tok_lib.load_hf_tokenizer(base_policy_dir)
    with pytest.raises(StalePolicyError):
        generate_groups(engine, tokenizer, TASKS[:1], SamplingConfig(group_size=1), require_version=1)
    new_dir = perturbed_copy(base_policy_dir, tmp_path_factory.mktemp("srv-refit") / "v1", version=1, noise=0.5, seed=1)
    before = generate_groups(engine, tokenizer, TASKS, SamplingConfig(group_size=2, seed=9)).rows
    info = engine.load_weights(new_dir)
    print(f"server refit: {info.seconds * 1000:.0f} ms, {info.bytes / 1e6:.1f} MB")
    assert engine.policy_version == 1 and info.policy_version == 1
    after = generate_groups(engine, tokenizer, TASKS, SamplingConfig(group_size=2, seed=9), require_version=1).rows
    assert {r["policy_version"] for r in after} == {1}
    assert [r["behaviour_logprobs"] for r in after] != [r["behaviour_logprobs"] for r in before]
    assert max_logprob_diff(new_dir, after) < 1e-3


def test_unauthenticated_refit_and_version_change_are_refused(engine, server, home):
    import requests

    from ops.serving.api_key import api_key

    version = engine.policy_version
    for path, body in (("/update_weight_version", {"new_version": "999"}),
                       ("/collective_rpc", {"method": "reload_weights_repacked", "kwargs": {"weights_path": "/nonexistent"}}),
                       ("/v1/models", None)):
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            r = requests.request("GET" if body is None else "POST", f"{server.url}{path}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    assert engine.policy_version == version, "the refused request changed nothing"
    r = requests.get(f"{server.url}/weight_info", headers={"Authorization": f"Bearer {api_key(home.root)}"}, timeout=30)
    assert r.status_code == 200


def test_client_errors_are_clear(server):
    from ops.rollout.server import ServerEngine

    with pytest.raises(EngineStartError, match="no vLLM server answers"):
        ServerEngine([f"http://127.0.0.1:{_free_port()}"])


def test_start_failure_names_the_memory_setting(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("ValueError: Available memory on node 0 (3.1/23 GiB) on kv cache allocation is less than requested memory\n")
    msg = vllm_server.start_failure(1, log, {"VLLM_CPU_KVCACHE_SPACE": "64"})
    assert "VLLM_CPU_KVCACHE_SPACE" in msg and "kv_cache_gib" in msg and "64 GiB" in msg


def test_stop_ends_the_server_process_group(server, home, monkeypatch, capsys):
    """`perpetua stop`: every server this home recorded, stale pid files included."""
    import json
    import subprocess

    import psutil

    from pipelines.cli import main

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = vllm_server.pid_file(home, 1)  # a server that died without cleaning up after itself
    stale.write_text(json.dumps({"pid": dead.pid}))
    monkeypatch.setenv("PERPETUA_HOME", str(home.root))
    assert main(["stop", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"vllm": [server.port], "learner": False, "mlflow": False, "dagster_daemon": False, "postgres": False}
    assert not stale.exists()
    assert not psutil.pid_exists(server.pid) or psutil.Process(server.pid).status() == psutil.STATUS_ZOMBIE
    assert vllm_server.status(server.port, h=home) is None
    assert not vllm_server.pid_file(home, server.port).exists()


def test_supervisor_lifecycle_on_a_small_http_server(tmp_path):
    """The lifecycle both servers share, on `python -m http.server` (seconds, no engine): start,
    reuse, a port held by a stranger, a failed start, a pid file left by a dead server, stop."""
    import json
    import subprocess
    import sys
    from dataclasses import asdict

    from ops.serving import supervisor

    class Err(RuntimeError):
        pass

    def svc(port):
        return supervisor.Service("test server", tmp_path / f"s-{port}.json", tmp_path / "logs" / f"s-{port}.log",
                                  (b"http.server",), vllm_server.VllmServer, Err,
                                  lambda url, t: supervisor.http_ok(url + "/", t))

    def launch_on(port, *extra):
        return lambda: supervisor.Launch([sys.executable, "-m", "http.server", *extra, "--bind", "127.0.0.1", str(port)], tmp_path)

    def ready_on(port):
        return lambda pid, url, s: vllm_server.VllmServer(url, pid, "127.0.0.1", port, "-", str(tmp_path), 0.0, s)

    port = _free_port()
    s = svc(port)
    with pytest.raises(Err, match="bind 127.0.0.1"):
        supervisor.start(s, "0.0.0.0", port, launch_on(port), ready_on(port), timeout_s=30)
    first = supervisor.start(s, "127.0.0.1", port, launch_on(port), ready_on(port), timeout_s=30)
    try:
        assert not first.reused and supervisor.status(s).pid == first.pid
        again = supervisor.start(s, "127.0.0.1", port, launch_on(port), ready_on(port), timeout_s=30)
        assert again.reused and again.pid == first.pid
        other = svc(_free_port())  # a different record whose port a stranger (our server) holds
        with pytest.raises(Err, match="already in use"):
            supervisor.start(other, "127.0.0.1", port, launch_on(port), ready_on(port), timeout_s=30)
        bad = _free_port()
        with pytest.raises(Err, match="exited with code 2"):
            supervisor.start(svc(bad), "127.0.0.1", bad, launch_on(bad, "--no-such-flag"), ready_on(bad), timeout_s=30)
        assert "no-such-flag" in supervisor.tail(svc(bad).log_file)
        ended = _free_port()  # a server another process ends during its start-up is named so
        # (SIGTERM's default action first: a child inherits an ignored SIGTERM, which the test
        # session may have, e.g. Dagster maps it to SIGINT's disposition in-process)
        term = "import os, signal; signal.signal(signal.SIGTERM, signal.SIG_DFL); os.kill(os.getpid(), signal.SIGTERM)"
        suicide = lambda: supervisor.Launch([sys.executable, "-c", term], tmp_path)  # noqa: E731
        with pytest.raises(Err, match=r"was ended by SIGTERM \(exit code -15\) during start-up"):
            supervisor.start(svc(ended), "127.0.0.1", ended, suicide, ready_on(ended), timeout_s=30)
        # ... and with a restart allowed it is started again once: here the first start is ended,
        # the second serves; one that exits by itself is not restarted
        marker = tmp_path / "ended-once"
        once = f"import os, pathlib, runpy, signal, sys; m = pathlib.Path({str(marker)!r}); " \
               f"signal.signal(signal.SIGTERM, signal.SIG_DFL); m.exists() or (m.touch(), os.kill(os.getpid(), signal.SIGTERM)); " \
               f"sys.argv = ['http.server', '--bind', '127.0.0.1', '{ended}']; runpy.run_module('http.server', run_name='__main__')"
        restarted = supervisor.start(svc(ended), "127.0.0.1", ended, lambda: supervisor.Launch([sys.executable, "-c", once, "http.server"], tmp_path),
                                     ready_on(ended), timeout_s=30, restarts=1)
        assert marker.exists() and supervisor.status(svc(ended)).pid == restarted.pid
        assert "was ended by SIGTERM (exit code -15) during start-up; starting it again" in svc(ended).log_file.read_text()
        supervisor.stop(svc(ended), grace_s=5)
        with pytest.raises(Err, match="exited with code 2"):
            supervisor.start(svc(bad), "127.0.0.1", bad, launch_on(bad, "--no-such-flag"), ready_on(bad), timeout_s=30,
                             restarts=1)

        def broken(pid, url, s):
            raise Err("set-up failed")

        unready = _free_port()
        with pytest.raises(Err, match="set-up failed"):  # a server whose set-up fails is not left running
            supervisor.start(svc(unready), "127.0.0.1", unready, launch_on(unready), broken, timeout_s=30)
        assert not supervisor.port_open("127.0.0.1", unready) and not svc(unready).pid_file.exists()
    finally:
        assert supervisor.stop(s, grace_s=5)
    assert not supervisor.port_open("127.0.0.1", port) and supervisor.status(s) is None
    assert not supervisor.stop(s, grace_s=5)
    dead = subprocess.Popen(["true"])
    dead.wait()
    s.pid_file.write_text(json.dumps({**asdict(first), "pid": dead.pid}))
    assert supervisor.status(s) is None and not s.pid_file.exists()  # stale: removed


def test_round_robin_spreads_and_fails_over():
    from ops.rollout.server import RoundRobin

    rr = RoundRobin(["http://a:1/", "http://b:2", "http://c:3"])
    firsts = [rr.order() for _ in range(4)]
    assert [o[0] for o in firsts] == ["http://a:1", "http://b:2", "http://c:3", "http://a:1"]
    assert all(sorted(o) == sorted(rr.urls) for o in firsts)  # every server is a fail-over candidate
    with pytest.raises(ValueError):
        RoundRobin([])


def test_parse_completion_is_token_in_token_out():
    from ops.rollout.engine import EngineFailure
    from ops.rollout.server import parse_completion

    resp = {"choices": [{"finish_reason": "stop", "stop_reason": 202, "token_ids": [7, 9, 202],
                         "logprobs": {"tokens": ["token_id:7", "token_id:9", "token_id:202"],
                                      "token_logprobs": [-0.1, -0.2, -0.3]}}]}
    r = parse_completion(resp)
    assert (r.token_ids, r.logprobs, r.finish_reason, r.stop_token_id) == ([7, 9, 202], [-0.1, -0.2, -0.3], "stop", 202)
    resp["choices"][0]["logprobs"]["tokens"] = ["a", "b", "c"]
    with pytest.raises(EngineFailure, match="return_tokens_as_token_ids"):
        parse_completion(resp)


def test_a_servers_socket_folder_is_its_own_and_short_enough_for_a_socket(tmp_path):
    from ops.common.paths import Home
    from ops.serving import vllm_server

    short = Home(Path("/tmp/h"))
    assert vllm_server.ipc_dir(short, 8000) == Path("/tmp/h/services/vllm-8000-ipc")
    deep = Home(tmp_path / ("a-long-test-folder-name" * 4) / "home")
    folder = vllm_server.ipc_dir(deep, 8000)
    assert len(str(folder / ("0" * 36))) < 108 and not folder.is_relative_to(deep.root)
    assert folder == vllm_server.ipc_dir(deep, 8000) != vllm_server.ipc_dir(deep, 8001)  # stop finds it again
