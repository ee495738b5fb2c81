"""`bench rollout`, small, against a real vLLM server: the ratio comes from the two measured
sides, both sides did the same work (same tokens, same episodes, token for token), and each
side reports its peak client and server RSS."""

from __future__ import annotations

import socket
import statistics

import pytest

from ops.bench.rollout import run_bench
from ops.common.paths import Home
from ops.serving import vllm_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Home:
    return Home(tmp_path_factory.mktemp("perpetua-home")).ensure()


@pytest.fixture(scope="module")
def server(home, base_policy_dir):
    from ops.rollout.vllm_engine import EngineConfig

    port = _free_port()
    info = vllm_server.start(base_policy_dir, EngineConfig(max_num_seqs=32), port=port, h=home)
    yield info
    vllm_server.stop(port, h=home)


def test_bench_rollout_compares_equal_work_on_one_server(server, home, base_policy_dir):
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
