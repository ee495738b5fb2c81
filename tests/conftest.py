"""Shared fixtures: an isolated PERPETUA_HOME per test, and session-wide tiny policies.

`random_policy_dir` is the tiny MoE with random weights (for parity and plumbing);
`base_policy_dir` is a quickly bootstrapped one (short SFT) that writes well-formed episodes,
for tests that need a policy that calls the tool. Both are HF Mixtral directories.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture
def perpetua_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "perpetua-home"
    monkeypatch.setenv("PERPETUA_HOME", str(home))
    from ops.common.paths import home as get_home

    return get_home().ensure().root


@pytest.fixture(scope="session")
def random_policy_dir(tmp_path_factory) -> Path:
    from ops.policy.bootstrap import random_policy

    return random_policy(tmp_path_factory.mktemp("random-policy"), seed=1234, version=None)


@pytest.fixture(scope="session")
def base_policy_dir(tmp_path_factory) -> Path:
    """A bootstrapped tiny policy (short SFT: follows the episode format, often right)."""
    from ops.policy.bootstrap import BootstrapConfig, bootstrap_base_policy
    from ops.policy.sft import SFTConfig

    out = tmp_path_factory.mktemp("base-policy")
    cfg = BootstrapConfig(sft=SFTConfig(max_steps=300, eval_every=100, target_success=0.6))
    return bootstrap_base_policy(out, cfg).hf_dir
