"""`perpetua bench verify`: how fast rollouts are verified, against the obvious way of doing it.

baseline  = one sandboxed process per calculator verification, one after another;
candidate = the project's path (ops.reward.scoring.verify_rollouts): many episodes' tool calls checked
            by one sandboxed runner process, batches spread over a worker pool sized to the
            machine.
ratio = baseline seconds / candidate seconds (> 1: the project's path is faster). Both paths
must give the same rewards, or the bench says so (`same_rewards`).

Each side reports its peak memory: the peak of the summed RSS of this process and the sandboxed
processes it started (`peak_rss_mb`), and of those processes alone (`peak_sandbox_rss_mb`),
sampled every 20 ms (ops/bench/memory.py), so a sandbox that lives shorter than that may be missed.

Also reported: the sandbox's own start-up cost (the same command with and without it) and
verifications/s of the pytest-based SWE verifier, serial and pooled, on a tiny generated repo.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ops.reward.sandbox import Sandbox
from ops.tasks.task_world import Task, generate_tasks, prompt_text, solution_text
from ops.reward.verifiers import VerifyItem, get_verifier
from ops.reward.scoring import default_workers, verify_rollouts

_MINI_REPO = {
    "mini/__init__.py": "def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n",
    "tests/test_mini.py": (
        "from mini import add, neg\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_neg():\n    assert neg(2) == -2\n"
    ),
}
_MINI_PATCH = """diff --git a/mini/__init__.py b/mini/__init__.py
--- a/mini/__init__.py
+++ b/mini/__init__.py
@@ -1,5 +1,5 @@
 def add(a, b):
-    return a - b
+    return a + b
 
 
 def neg(a):
"""


def _episodes(n: int) -> tuple[list[dict], dict[str, Task]]:
    """n calculator rollouts: honest solutions, and every third one with tampered tool output."""
    tasks = [t for fam in ("add", "sub", "mul") for t in generate_tasks(fam, n // 3 + 1, seed=7)][:n]
    rows = []
    for i, t in enumerate(tasks):
        completion = solution_text(t)[len(prompt_text(t)) :]
        if i % 3 == 2:
            completion = completion.replace(f"RESULT {t.answer}", f"RESULT {int(t.answer) + 1}")
        rows.append({"group_id": f"{t.task_id}:bench", "sample_index": 0, "task_id": t.task_id,
                     "prompt_text": prompt_text(t), "completion_text": completion})
    return rows, {t.task_id: t for t in tasks}


MEMORY_INTERVAL_S = 0.02


def _measured(fn) -> tuple[object, float, dict]:
    """`fn()`, its wall seconds, and the peak RSS of this process's tree while it ran (every
    child is a sandboxed verification)."""
    from ops.bench.memory import TreeMemory

    groups = {"tree": None, "sandboxes": {"sandbox"}}
    with TreeMemory(os.getpid(), lambda argv: "sandbox", "bench", groups, MEMORY_INTERVAL_S) as memory:
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
    memory.sample()  # at least one sample, however short the side
    return out, seconds, {"peak_rss_mb": round(memory.peak_mb["tree"], 1),
                          "peak_sandbox_rss_mb": round(memory.peak_mb["sandboxes"], 1)}


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sandbox_overhead(sandbox: Sandbox, repeats: int) -> dict:
    argv = [sys.executable, "-c", "pass"]
    plain = _median_seconds(lambda: subprocess.run(argv, check=True, stdin=subprocess.DEVNULL), repeats)
    boxed = _median_seconds(lambda: sandbox.run(argv), repeats)
    true_plain = _median_seconds(lambda: subprocess.run(["true"], check=True), repeats)
    true_boxed = _median_seconds(lambda: sandbox.run(["true"]), repeats)
    return {
        "command": "python -c pass", "unsandboxed_ms": round(plain * 1e3, 2), "sandboxed_ms": round(boxed * 1e3, 2),
        "overhead_ms": round((boxed - plain) * 1e3, 2),
        "true_unsandboxed_ms": round(true_plain * 1e3, 2), "true_sandboxed_ms": round(true_boxed * 1e3, 2),
    }


def _swe(sandbox: Sandbox, n: int, workers: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="perpetua-bench-swe-") as tmp:
        repo = Path(tmp) / "repo"
        for rel, text in _MINI_REPO.items():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
        task = {"task_id": "mini", "verifier": "swe", "repo": str(repo),
                "fail_to_pass": ["tests/test_mini.py::test_add"], "pass_to_pass": ["tests/test_mini.py::test_neg"]}
        rows = [{"group_id": "mini:bench", "sample_index": i, "task_id": "mini", "prompt_text": "",
                 "completion_text": _MINI_PATCH} for i in range(n)]
        start = time.perf_counter()
        serial = verify_rollouts(rows, {"mini": task}, sandbox=sandbox, workers=1)
        serial_s = time.perf_counter() - start
        start = time.perf_counter()
        pooled = verify_rollouts(rows, {"mini": task}, sandbox=sandbox, workers=workers)
        pooled_s = time.perf_counter() - start
    rewards = [r["reward"] for r in serial.rows + pooled.rows]
    return {
        "verifications": n, "serial_seconds": round(serial_s, 3), "pooled_seconds": round(pooled_s, 3),
        "serial_verifications_per_second": round(n / serial_s, 3), "pooled_verifications_per_second": round(n / pooled_s, 3),
        "workers": workers, "all_rewarded": all(r == 1.0 for r in rewards),
    }


def run_bench(n_episodes: int = 60, n_swe: int = 4, repeats: int = 5, workers: int | None = None) -> dict:
    """The bench JSON (docs/architecture.md: name, ratio, baseline, candidate, plus details)."""
    sandbox = Sandbox()
    workers = workers or default_workers()
    rows, tasks = _episodes(n_episodes)
    calculator = get_verifier("calculator")

    def one_by_one() -> list[float]:
        return [v.reward for row in rows
                for v in calculator.verify_batch([VerifyItem.from_rollout(row, tasks[row["task_id"]])], sandbox)]

    baseline_rewards, baseline_s, baseline_mem = _measured(one_by_one)
    report, candidate_s, candidate_mem = _measured(lambda: verify_rollouts(rows, tasks, sandbox=sandbox, workers=workers))
    candidate_rewards = [r["reward"] for r in report.rows]

    return {
        "name": "verify",
        "ratio": round(baseline_s / candidate_s, 3),
        "baseline": {
            "what": "calculator verifier, one sandboxed process per verification, serially",
            "verifications": len(rows), "seconds": round(baseline_s, 3),
            "verifications_per_second": round(len(rows) / baseline_s, 2), **baseline_mem,
        },
        "candidate": {
            "what": f"ops.reward.scoring.verify_rollouts: batched runner (up to {calculator.batch_size} episodes per sandboxed "
                    f"process) on a pool of {workers} workers",
            "verifications": len(rows), "seconds": round(candidate_s, 3),
            "verifications_per_second": round(len(rows) / candidate_s, 2), **candidate_mem,
        },
        "same_rewards": baseline_rewards == candidate_rewards,
        "mean_reward": round(sum(candidate_rewards) / len(candidate_rewards), 4),
        "isolation": sandbox.isolation,
        "sandbox_overhead": _sandbox_overhead(sandbox, repeats),
        "swe_pytest": _swe(sandbox, n_swe, workers),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run_bench(), indent=2))


# ---- the reward-hacking suite (`perpetua bench verify --hacks`) ------------------------------

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
# earlier adversarial patches of the SWE fixture that belong to the suite as well
_SWE_EXTRA = ("deletes_tests", "edits_tests", "conftest_hack", "conftest_monkeypatch", "kills_parent")


class HackSuiteMissing(FileNotFoundError):
    pass


def _hack_cases(fixtures: Path) -> list[tuple[str, str, str, str]]:
    """(verifier, case name, description, response) of every attack, plus the honest ones
    (`good`), which must still score 1."""
    swe_dir, calc_dir = fixtures / "swe_repo" / "patches", fixtures / "calculator_hacks"
    if not (swe_dir / "hacks").is_dir() or not calc_dir.is_dir():
        raise HackSuiteMissing(f"the reward-hacking suite is not in this checkout ({swe_dir / 'hacks'}, {calc_dir})")
    cases = []
    for path in sorted((swe_dir / "hacks").glob("*.diff")) + [swe_dir / f"{n}.diff" for n in _SWE_EXTRA]:
        text = path.read_text()
        what = text.splitlines()[0].lstrip("# ") if text.startswith("#") else path.stem
        cases.append(("swe", path.stem, what, text))
    cases.append(("swe", "good", "the correct patch", (swe_dir / "good.diff").read_text()))
    for path in sorted(calc_dir.glob("*.txt")):
        cases.append(("calculator", path.stem, path.stem.replace("_", " "), path.read_bytes().decode()))
    cases.append(("calculator", "excessive_output", "a megabyte of text inside the episode",
                  "CALL calc(12+7)\nRESULT 19\n" + "x" * (1 << 20) + "\nANSWER 19\n"))
    return cases


def run_hacks(fixtures: Path | None = None, *, wall_seconds: float = 15.0, workers: int | None = None) -> dict:
    """Score every attack exactly as a cycle would; each must score 0 and be flagged, and the
    honest responses must score 1. `wall_seconds` bounds the SWE runs (the timeout attack)."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from ops.reward.verifiers.swe import SweTask, verify_patch

    fixtures = fixtures or FIXTURES
    cases = _hack_cases(fixtures)
    sandbox = Sandbox()
    swe_task = SweTask.from_record(json.loads((fixtures / "swe_repo" / "task.json").read_text()), fixtures / "swe_repo")
    calc_task = json.loads((fixtures / "calculator_hacks" / "task.json").read_text())
    swe_limits = sandbox.limits.but(wall_seconds=wall_seconds, cpu_seconds=max(sandbox.limits.cpu_seconds, wall_seconds))

    def score(case):
        verifier, name, what, response = case
        if verifier == "swe":
            v = verify_patch(swe_task, response, sandbox, limits=swe_limits)
        else:
            item = VerifyItem("hacks", 0, calc_task["task_id"], prompt_text(Task(**{k: calc_task[k] for k in (
                "task_id", "family", "question", "expression", "answer")})), response, calc_task)
            [v] = get_verifier("calculator").verify_batch([item], sandbox)
        honest = name == "good"
        caught = v.reward == 1.0 and not v.flagged if honest else v.reward == 0.0 and v.flagged
        return {"verifier": verifier, "case": name, "what": what, "honest": honest, "reward": v.reward,
                "flagged": v.flagged, "outcome": str(v.outcome), "guards": v.details.get("guards", []), "ok": caught}

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        results = list(pool.map(score, cases))
    attacks = [r for r in results if not r["honest"]]
    honest = [r for r in results if r["honest"]]
    return {
        "name": "verify-hacks", "cases": len(attacks), "caught": sum(r["ok"] for r in attacks),
        "missed": [f"{r['verifier']}/{r['case']}" for r in attacks if not r["ok"]],
        "honest_ok": all(r["ok"] for r in honest), "ok": all(r["ok"] for r in results),
        "seconds": round(time.monotonic() - start, 2), "isolation": sandbox.isolation, "results": results,
    }
