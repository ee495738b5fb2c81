"""The README's minimal environment, run as written: registered, listed by `perpetua envs`, its
tasks and truth, its episodes through the real episode runner and its rewards through the real
verifier registry and sandbox. Also the command-line checks of environments (`perpetua envs
--json`, `perpetua demo --env` on bad input) and the home's environment record."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from ops.envs import describe_environments, get_environment
from ops.rollout.groups import SamplingConfig, generate_groups
from ops.reward.scoring import verify_rollouts
from scripted_engine import ScriptedEngine

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    m = re.search(r"<!-- example-environment -->\n```python\n(.*?)```", text, re.S)
    assert m, "README.md has no <!-- example-environment --> python block"
    return m.group(1)


@pytest.fixture(scope="module")
def shout():
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(readme_example(), str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    return get_environment("shout")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, shout):
    from ops.policy import tokenizer as tok_lib

    out = tmp_path_factory.mktemp("tok")
    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(512, env=shout), out)
    return tok_lib.load_hf_tokenizer(out)


def test_the_readme_environment_registers_and_is_listed(shout, capsys):
    from pipelines.cli import main

    assert {"name": "shout", "version": "1", "description": shout.description, "demo": False} in describe_environments()
    assert main(["envs", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in listed] == sorted(e["name"] for e in listed)
    assert {"calculator", "reasoning_gym", "code_repair", "shout"} <= {e["name"] for e in listed}
    assert all(set(e) == {"name", "version", "description", "demo"} for e in listed)
    assert {e["name"]: e["demo"] for e in listed}["calculator"] is True
    assert {e["name"]: e["demo"] for e in listed}["code_repair"] is False


def test_tasks_truth_and_harvest_signature(shout):
    tasks = shout.generate_tasks("shout_two", 20, seed=3)
    assert len({t.task_id for t in tasks}) == 20 and tasks == shout.generate_tasks("shout_two", 20, seed=3)
    assert shout.bootstrap_families == ["shout"] and shout.drift_families == ["shout_two"]
    t = tasks[0]
    # what the harvest derives from a production question equals the generator's truth
    assert shout.ground_truth(t.family, t.question)[:2] == (t.expression, t.answer)
    assert shout.ground_truth(t.family, "shout ") is None  # no truth: counted unverifiable, never guessed
    assert shout.signature(t.question.upper()) == shout.signature(t.question)
    record = shout.truth_record(t)
    assert record["verifier"] == "exact" and json.loads(record["verifier_spec"])["answer"] == t.answer
    assert abs(sum(shout.production_mix(0.0).values()) - 1) < 1e-9 and "shout_two" not in shout.production_mix(0.0)
    assert shout.production_mix(1.0)["shout_two"] > shout.production_mix(1.0)["shout"]


def test_episodes_run_and_are_verified_by_the_registry(shout, tokenizer):
    tasks = shout.generate_tasks("shout", 4, seed=0)
    by_question = {t.question: t for t in tasks}

    def policy(prompt: str, request) -> str:  # right on even sample seeds, wrong (lower case) otherwise
        task = by_question[prompt.rstrip("\n").removeprefix(shout.prompt_prefix)]
        answer = task.answer if request.seed % 2 == 0 else task.answer.lower()
        return f"ANSWER {answer}\n"

    batch = generate_groups(ScriptedEngine(tokenizer, policy), tokenizer, tasks, SamplingConfig(group_size=4, max_tokens=32),
                            env=shout)
    assert len(batch.rows) == 16 and {r["environment"] for r in batch.rows} == {"shout"}
    assert {r["environment_version"] for r in batch.rows} == {"1"}
    assert {r["finish_reason"] for r in batch.rows} == {"answer"}
    truth = {t.task_id: shout.truth_record(t) for t in tasks}
    report = verify_rollouts(batch.rows, truth)
    assert report.versions == {"exact": "1"}
    for row, reward in zip(batch.rows, report.rows):
        expected = 1.0 if row["completion_text"].strip() == f"ANSWER {truth[row['task_id']]['answer']}" else 0.0
        assert reward["reward"] == expected and reward["environment"] == "shout"
    assert 0 < sum(r["reward"] for r in report.rows) < 16


# ---- the command line and the home's record --------------------------------------------------


def _cli(capsys, *argv) -> tuple[int, str]:
    from pipelines.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def test_demo_env_errors_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PERPETUA_HOME", str(tmp_path / "home"))
    code, text = _cli(capsys, "demo", "--env", "nope")
    assert code == 2 and "no environment named 'nope'" in text and "Traceback" not in text
    code, text = _cli(capsys, "demo", "--env", "code_repair")
    assert code == 2 and "cannot run the demo" in text and "Traceback" not in text
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "environment.json").write_text(json.dumps({"name": "calculator", "version": "1"}))
    code, text = _cli(capsys, "demo", "--env", "reasoning_gym")
    assert code == 2 and "trains the 'calculator' environment" in text and "Traceback" not in text


def test_a_home_keeps_its_environment(tmp_path, monkeypatch):
    from ops.common.paths import Home
    from ops.envs.home import EnvironmentMismatch, bind_environment, home_environment, stage_code_version

    h = Home(tmp_path / "home")
    monkeypatch.delenv("PERPETUA_ENVIRONMENT", raising=False)
    assert home_environment(h).name == "calculator" and stage_code_version("rollouts-3", h) == "rollouts-3"
    monkeypatch.setenv("PERPETUA_ENVIRONMENT", "reasoning_gym")
    assert home_environment(h).name == "reasoning_gym"  # a new home takes the asked one
    assert not (h.root / "environment.json").exists()  # reading never writes
    bind_environment(get_environment("reasoning_gym"), h)
    assert stage_code_version("rollouts-3", h) == "rollouts-3+reasoning_gym-1"
    monkeypatch.setenv("PERPETUA_ENVIRONMENT", "calculator")
    with pytest.raises(EnvironmentMismatch, match="trains the 'reasoning_gym' environment"):
        home_environment(h)
    monkeypatch.delenv("PERPETUA_ENVIRONMENT")
    assert home_environment(h).name == "reasoning_gym"


def test_an_environment_from_a_package_entry_point_registers(tmp_path, monkeypatch, capsys):
    """A package's `perpetua.environments` entry point is loaded once; a broken one is logged and
    the rest of the registry still loads."""
    from importlib.metadata import EntryPoint

    from ops import envs
    from ops.common import plugins
    from pipelines.cli import main

    (tmp_path / "my_plugin_envs.py").write_text(readme_example().replace('"shout", "1"', '"shout_plugin", "2"'))
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [EntryPoint("shout_plugin", "my_plugin_envs:Shout", envs.ENTRY_POINT_GROUP),
           EntryPoint("broken", "no_such_module_here:Env", envs.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(plugins, "entry_points", lambda group: eps if group == envs.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(plugins, "_loaded_groups", set())
    try:
        assert get_environment("shout_plugin").version == "2"
        assert main(["envs", "--json"]) == 0
        assert "shout_plugin" in {e["name"] for e in json.loads(capsys.readouterr().out)}
        with pytest.raises(envs.UnknownEnvironment, match="no environment named 'broken'"):
            get_environment("broken")
    finally:
        envs._REGISTRY.pop("shout_plugin", None)
        sys.modules.pop("my_plugin_envs", None)
