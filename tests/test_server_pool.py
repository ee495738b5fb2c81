"""A role's pool of vLLM servers (assets/resources.py PolicyServer with replicas, ops/rollout/server.py):
the pool's bookkeeping and configuration without servers, then two real CPU servers started
through `PolicyServer(replicas=2)`, both refit, one SIGKILLed in the middle of a rollout.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from ops.tasks import task_world

TASKS = [t for fam in ("add", "sub", "mul_words") for t in task_world.generate_tasks(fam, 6, seed=31)]
GROUP_SIZE = 4


def _free_port_pair() -> int:
    """A port whose successor is free too (a pool of two takes PORT and PORT+1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


# ---- without servers -------------------------------------------------------------------------


def test_pool_bookkeeping_takes_a_member_out_and_back():
    from ops.rollout.server import RoundRobin

    pool = RoundRobin(["http://a:1", "http://b:2/", "http://c:3"])
    assert [pool.order()[0] for _ in range(3)] == ["http://a:1", "http://b:2", "http://c:3"]
    assert pool.begin("http://b:2") and pool.begin("http://b:2")  # two requests in flight on b
    pool.end("http://b:2", answered=True)
    failure = pool.take_out("http://b:2", "connection refused")
    assert (failure.url, failure.in_flight, failure.sent) == ("http://b:2", 1, 2)
    assert pool.take_out("http://b:2", "again") is None  # recorded once
    assert not pool.begin("http://b:2", failover=True)  # nothing reaches a member that is out
    assert pool.live == ["http://a:1", "http://c:3"]
    assert all("http://b:2" not in pool.order() for _ in range(4))
    assert {pool.order()[0] for _ in range(4)} == {"http://a:1", "http://c:3"}  # turns over the live ones
    pool.end("http://b:2", answered=False)  # the request in flight on b fails ...
    assert pool.begin("http://a:1", failover=True)  # ... and goes to a
    pool.end("http://a:1", answered=True)
    record = pool.record()
    assert record["live"] == ["http://a:1", "http://c:3"] and record["failovers"] == 1
    assert record["requests"] == {"http://a:1": 1, "http://b:2": 2, "http://c:3": 0}
    assert [f["url"] for f in record["failed_servers"]] == ["http://b:2"]
    assert pool.members["http://b:2"].failed == 1
    pool.rejoin("http://b:2")
    assert pool.live == pool.urls and len(pool.failures) == 1  # the failure stays on record
    with pytest.raises(ValueError, match="twice"):
        RoundRobin(["http://a:1", "http://a:1/"])


def test_local_pool_configuration(monkeypatch):
    from assets.resources import PolicyServer, for_environment

    for var in ("PERPETUA_TRAINER_PORT", "PERPETUA_PRODUCTION_PORT", "PERPETUA_TRAINER_REPLICAS", "PERPETUA_PRODUCTION_REPLICAS"):
        monkeypatch.delenv(var, raising=False)
    default = for_environment("local")
    assert default["trainer_server"].local_ports() == [8001] and default["production_server"].local_ports() == [8000]
    monkeypatch.setenv("PERPETUA_TRAINER_PORT", "8010")
    monkeypatch.setenv("PERPETUA_TRAINER_REPLICAS", "3")
    monkeypatch.setenv("PERPETUA_PRODUCTION_REPLICAS", "2")
    pools = for_environment("local")
    assert pools["trainer_server"].local_ports() == [8010, 8011, 8012]
    assert pools["trainer_server"].urls() == [f"http://127.0.0.1:{p}" for p in (8010, 8011, 8012)]
    assert pools["production_server"].local_ports() == [8000, 8001]
    monkeypatch.setenv("PERPETUA_TRAINER_PORT", "8001")  # production's second server is on 8001
    with pytest.raises(ValueError, match=r"share port\(s\) \[8001\]"):
        for_environment("local")
    monkeypatch.setenv("PERPETUA_TRAINER_REPLICAS", "0")
    with pytest.raises(ValueError, match="PERPETUA_TRAINER_REPLICAS must be >= 1"):
        for_environment("local")
    remote = PolicyServer(base_urls=["http://a:8000", "http://b:8000"], autostart=False)
    assert remote.urls() == ["http://a:8000", "http://b:8000"] and remote.local_ports() == [] and remote.server_pids() == []
    with pytest.raises(ValueError, match="replicas .* is for local servers"):
        PolicyServer(base_urls=["http://a:8000"], replicas=2).urls()


# ---- two real servers --------------------------------------------------------------------------


@pytest.fixture
def pool(perpetua_home, base_policy_dir, monkeypatch):
    """`PolicyServer(replicas=2)` on two free ports, both servers started together; every server is
    stopped afterwards, also when the test fails."""
    from assets.resources import PolicyServer
    from ops.serving import vllm_server

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    servers = PolicyServer(port=_free_port_pair(), replicas=2)
    try:
        began = time.monotonic()
        started = servers.warm(base_policy_dir, 0)
        print(f"two vLLM servers healthy after {time.monotonic() - began:.1f} s "
              f"({', '.join(f'{s.start_seconds:.1f} s' for s in started)} each)")
        yield servers
    finally:
        for port in servers.local_ports():
            vllm_server.stop(port)


def _served_version(url: str) -> int | None:
    import requests

    from ops.rollout.engine import parse_weight_version
    from ops.serving.api_key import auth_headers

    return parse_weight_version(requests.get(f"{url}/weight_info", headers=auth_headers(), timeout=10).json()["weight_version"])


def _kill_when_busy(engine, victim_url: str, victim_pid: int, killed: dict) -> None:
    """SIGKILL the victim's process group mid-rollout and mid-call: at the first moment both servers
    have answered requests and several more are in flight on the victim, unanswered. That moment
    comes in the first turn (the victim answers its shortest completions first) or in a later
    one; which turn depends on the completions the CPU sampled, so the test does not pin it."""
    members = engine.router.members
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all(m.answered for m in members.values()) and members[victim_url].in_flight >= 4:
            killed["in_flight"] = members[victim_url].in_flight
            killed["answered_before"] = members[victim_url].answered
            killed["calls_before"] = engine.stats.calls
            os.killpg(victim_pid, signal.SIGKILL)
            killed["at"] = time.time()
            return
        time.sleep(0.002)


def test_a_server_killed_mid_rollout_is_taken_out_and_the_rollout_completes_on_the_other(
        pool, base_policy_dir, tmp_path):
    from ops.bench.rollout import perturbed_copy
    from ops.policy.tokenizer import load_hf_tokenizer
    from ops.rollout.engine import TurnRequest
    from ops.rollout.groups import SamplingConfig, generate_groups
    from ops.serving import vllm_server

    v1 = perturbed_copy(base_policy_dir, tmp_path / "v1", version=1, noise=0.02, seed=1)
    engine = pool.engine(v1, 1)  # the pool's client: refits both servers from v0 to v1
    urls = pool.urls()
    assert engine.router.urls == urls and engine.policy_version == 1
    assert [_served_version(u) for u in urls] == [1, 1]
    assert [r.policy_version for r in engine.stats.refits] == [1]

    victim_url, survivor_url = urls[1], urls[0]
    victim_pid = vllm_server.status(pool.local_ports()[1]).pid
    killed: dict = {}
    killer = threading.Thread(target=_kill_when_busy, args=(engine, victim_url, victim_pid, killed), daemon=True)
    began = time.monotonic()
    killer.start()
    batch = generate_groups(engine, load_hf_tokenizer(v1), TASKS, SamplingConfig(group_size=GROUP_SIZE, seed=7),
                            cycle=1, require_version=1)
    seconds = time.monotonic() - began
    killer.join(timeout=5)
    assert killed, f"the rollout ({seconds:.1f} s) ended before both servers were busy"

    # Every episode is present and well formed, all its turns from policy version 1.
    rows = batch.rows
    assert len(rows) == len(TASKS) * GROUP_SIZE and batch.policy_version == 1
    assert {(r["task_id"], r["sample_index"]) for r in rows} == {(t.task_id, i) for t in TASKS for i in range(GROUP_SIZE)}
    for r in rows:
        assert r["policy_version"] == 1
        assert r["finish_reason"] not in ("engine_error", "env_error"), r["error"]
        assert len(r["completion_ids"]) == len(r["behaviour_logprobs"]) == len(r["loss_mask"]) > 0
    assert engine.stats.retries == 0  # no generate call failed as a whole: the survivor took over

    # The killed server is reported; the requests it had in flight went to the survivor, and
    # no request reached it once it was out.
    [failure] = engine.failed_servers
    victim, survivor = engine.router.members[victim_url], engine.router.members[survivor_url]
    assert failure.url == victim_url and failure.at >= killed["at"] and failure.error
    assert engine.router.live == [survivor_url]
    assert 1 <= victim.failed <= failure.in_flight  # requests lost with the server (a few may have finished first)
    assert engine.router.failovers == victim.failed  # each one sent again, to the survivor ...
    assert survivor.answered == survivor.sent and survivor.failed == 0  # ... which answered them all
    assert victim.sent == failure.sent and victim.in_flight == 0  # nothing sent after it was taken out
    record = engine.pool_record()
    assert record["live"] == [survivor_url] and [f["url"] for f in record["failed_servers"]] == [victim_url]
    print(f"rollout of {len(rows)} episodes in {seconds:.1f} s; killed {victim_url} with {killed['in_flight']} requests "
          f"in flight after it answered {killed['answered_before']} (after {killed['calls_before']} generate calls); taken out {failure.at - killed['at']:.3f} s later "
          f"with {failure.in_flight} in flight, {victim.failed} failed there and were answered by the survivor; "
          f"requests: {record['requests']}")

    # A refit reaches the survivor and leaves the dead server out.
    engine.load_weights(v1, 1)
    assert engine.router.live == [survivor_url] and engine.policy_version == 1 and len(engine.failed_servers) == 1

    # Every server down: the restart hook (the supervisor) starts the dead one, and each is refit
    # to the pool's weights and version before it is used again.
    engine.router.take_out(survivor_url, "taken out by the test")
    began = time.monotonic()
    [result] = engine.generate_turns([TurnRequest(rows[0]["prompt_ids"], max_tokens=4, seed=1)], require_version=1)
    print(f"restart of the pool (the dead server started again, both refit) and one request: {time.monotonic() - began:.1f} s")
    assert result.error is None and result.policy_version == 1
    assert engine.stats.restarts == 1 and sorted(engine.router.live) == sorted(urls)
    assert [_served_version(u) for u in urls] == [1, 1]
    assert vllm_server.status(pool.local_ports()[1]).pid != victim_pid
    engine.close()
