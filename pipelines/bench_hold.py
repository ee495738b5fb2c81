"""`perpetua bench hold`: does the loop keep what it learned? Every policy that served production
after a cycle of this home, on the same fresh traffic, each paired with the one before it.

The production failure rate the demo logs before each cycle is measured on that cycle's own
stretch of traffic, and the drift changes that traffic: a family that arrives in a stretch fails
there before any cycle could learn it, so a rise from one stretch to the next mixes the policy
with the traffic. Here the traffic is held fixed instead: one seeded sample of the whole drift
(production time 0 to 1, every family, `requests` requests, the simulator's serving settings),
sent to every policy that served after a cycle (the champion before cycle 1, then after each
cycle the candidate the gate deployed or the champion it kept), one vLLM server refitted from
one policy to the next. A request is the same question for every policy, and serving is greedy,
so each change of the serving policy is a paired comparison: the requests it fixed and those it
broke, with the exact McNemar interval the deploy gate uses (ops/evaluate/paired.py). The loop
holds when no change is significantly worse (the interval's upper bound of the gain is not below
zero). The ratio is the first serving policy's failure rate over the last one's (> 1: the loop
left production better than it found it).

The traffic's seed is apart from every stretch a demo simulates (pipelines/demo.py), and its
traces go to `PERPETUA_HOME/bench/hold/`, not to the landing zone the loop harvests.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ops.common.paths import Home, home
from ops.evaluate.paired import exact_mcnemar
from ops.evaluate.report import CYCLE, cycle_reports
from ops.harvest.contract import TraceRecord
from ops.policy import versions as policies

SEED_BASE = 50_000  # no demo stretch uses it: a demo seed s simulates seeds s * 100_000 + stretch
ALPHA = 0.05  # one-sided, as the deploy gate's (a 90% two-sided interval)


def serving_after_cycles(data_dir: Path) -> list[tuple[int, int]]:
    """(cycle, policy version serving after it) for every cycle with a report, in order, after
    (0, the champion before the first reported cycle). A cycle whose gate passed serves its
    candidate; one whose gate blocked keeps its champion."""
    out: list[tuple[int, int]] = []
    for report in cycle_reports(data_dir):
        if report.get("kind") != CYCLE:
            continue
        if not out:
            out.append((0, int(report["champion_version"])))
        passed = bool((report.get("gate") or {}).get("passed"))
        out.append((int(report["cycle"]), int(report["candidate_version"] if passed else report["champion_version"])))
    return out


def outcomes(records: list[TraceRecord]) -> list[tuple[str, str, bool]]:
    """(question, family, failed) per request, in the order sent."""
    return [(r.question, r.family, r.outcome != "success") for r in records]


def compare(before: list[tuple[str, str, bool]], after: list[tuple[str, str, bool]]) -> dict:
    """The change from `before` to `after` on the same requests: fixed, broken, and the exact
    McNemar gain (fewer failures = positive) with its interval."""
    if [q for q, _, _ in before] != [q for q, _, _ in after]:
        raise ValueError("the two policies were not sent the same requests")
    fixed = sum(a and not b for (_, _, a), (_, _, b) in zip(before, after))
    broken = sum(b and not a for (_, _, a), (_, _, b) in zip(before, after))
    test = exact_mcnemar(fixed, broken, len(after), alpha=ALPHA)
    return {"fixed": fixed, "broken": broken, "gain": round(test.gain, 4),
            "gain_ci": [round(test.ci[0], 4), round(test.ci[1], 4)], "worse": test.ci[1] < 0}


def by_family(before: list[tuple[str, str, bool]], after: list[tuple[str, str, bool]]) -> dict[str, dict]:
    """`compare` within each family's requests: which families the change fixed, and whether one
    got significantly worse (a bootstrap family the loop forgot while it learned the drift)."""
    families = sorted({f for _, f, _ in before})
    return {f: compare([r for r in before if r[1] == f], [r for r in after if r[1] == f]) for f in families}


def failure_rates(results: list[tuple[str, str, bool]]) -> dict[str, float]:
    """Failure rate per family and `_overall`."""
    by: dict[str, list[int]] = {}
    for _, family, failed in results:
        by.setdefault(family, [0, 0])
        by[family][0] += 1
        by[family][1] += failed
    rates = {f: round(k / n, 4) for f, (n, k) in sorted(by.items())}
    return rates | {"_overall": round(sum(f for *_, f in results) / len(results), 4) if results else None}


def simulate_each(h: Home, versions: list[int], requests: int, seed: int, out_dir: Path,
                  log=print) -> dict[int, list[tuple[str, str, bool]]]:
    """Every policy version on the same traffic (one vLLM server, refitted from one to the next):
    per version its outcomes, its traces under out_dir/traffic-vN."""
    from ops.envs.home import home_environment
    from ops.harvest.simulator import SimulatorConfig, run_simulation
    from ops.policy import tokenizer as tok_lib
    from ops.rollout.server import ServerEngine
    from ops.serving import vllm_server

    env = home_environment(h)
    server = vllm_server.start_on_free_port(policies.hf_dir(versions[0], h), policy_version=versions[0], h=h)
    results = {}
    try:
        with ServerEngine([server.url]) as engine:
            for version in versions:
                model_dir = policies.hf_dir(version, h)
                if engine.policy_version != version:
                    engine.load_weights(model_dir, version)
                folder = out_dir / f"traffic-v{version}"
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                start = time.monotonic()
                cfg = SimulatorConfig(requests=requests, seed=seed, model_version=str(version))
                result = run_simulation(engine, tok_lib.load_hf_tokenizer(model_dir), folder, cfg, env=env)
                if result.stopped_early:
                    raise RuntimeError(f"the traffic to policy version {version} stopped early: {result.stopped_early}")
                results[version] = outcomes(result.records)  # as written to the traces, not read back
                log(f"bench hold: policy v{version}: {sum(f for *_, f in results[version])} of {requests} requests "
                    f"failed ({time.monotonic() - start:.0f} s)")
    finally:
        vllm_server.stop(server.port, h)
    return results


def run_bench(requests: int = 480, seed: int = 0, log=print) -> dict:
    """Every serving policy of this home's cycles on one fresh traffic sample (traffic seed
    SEED_BASE + seed), each change of the serving policy compared with the one before it."""
    if requests < 1:
        raise ValueError("--requests must be at least 1")
    h = home().ensure()
    history = serving_after_cycles(h.data)
    if len(history) < 2:
        raise ValueError(f"no cycle report in {h.data}: run cycles in this home first (`perpetua demo`), "
                         "or point PERPETUA_HOME at a demo's home")
    versions = list(dict.fromkeys(v for _, v in history))
    missing = [v for v in versions if not (policies.hf_dir(v, h) / "config.json").exists()]
    if missing:
        raise ValueError(f"policy version(s) {missing} served after a cycle but have no HF export in {h.models}")
    out_dir = h.root / "bench" / "hold"
    log(f"bench hold: {len(versions)} serving policies ({', '.join(f'v{v}' for v in versions)}) on the same "
        f"{requests} requests (traffic seed {SEED_BASE + seed})")
    results = simulate_each(h, versions, requests, SEED_BASE + seed, out_dir, log)
    rows, before = [], None
    for cycle, version in history:
        row = {"cycle": cycle, "policy_version": version, "failure_rate": failure_rates(results[version])}
        if before is not None and before != version:
            row["change"] = {"from_version": before} | compare(results[before], results[version])
        rows.append(row)
        before = version
    first, last = rows[0]["failure_rate"]["_overall"], rows[-1]["failure_rate"]["_overall"]
    result = {"name": "hold", "ratio": round(first / last, 3) if last else None,
              "what": "failure rate of the policy serving before the first cycle / after the last, on the same fresh "
                      "traffic (> 1: the loop left production better)",
              "requests": requests, "traffic_seed": SEED_BASE + seed, "holds": not any(r.get("change", {}).get("worse")
                                                                                     for r in rows),
              "cycles": rows, "first_to_last": by_family(results[history[0][1]], results[history[-1][1]])}
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


def format_table(result: dict) -> str:
    """One line per cycle: the serving policy, its failure rate overall and per family, and the
    paired change when the serving policy changed."""
    families = [f for f in result["cycles"][0]["failure_rate"] if f != "_overall"]
    head = ["after cycle", "serving", "failure (overall)"] + families + ["change: fixed / broken, gain (90% CI)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["cycles"]:
        rates = r["failure_rate"]
        change = r.get("change")
        note = "" if change is None else (f"{change['fixed']} / {change['broken']}, {change['gain']:+.3f} "
                                          f"[{change['gain_ci'][0]:+.3f}, {change['gain_ci'][1]:+.3f}]"
                                          + (" worse" if change["worse"] else ""))
        cells = ["before 1" if r["cycle"] == 0 else str(r["cycle"]), f"v{r['policy_version']}",
                 f"{rates['_overall']:.3f}"] + [f"{rates.get(f, 0):.2f}" for f in families] + [note]
        lines.append("| " + " | ".join(cells) + " |")
    first, last = result["cycles"][0]["policy_version"], result["cycles"][-1]["policy_version"]
    lines.append(f"\nv{first} -> v{last} by family (fixed / broken, gain, 90% CI): " + "; ".join(
        f"{f} {c['fixed']} / {c['broken']}, {c['gain']:+.3f} [{c['gain_ci'][0]:+.3f}, {c['gain_ci'][1]:+.3f}]"
        + (" worse" if c["worse"] else "") for f, c in result["first_to_last"].items()))
    verdict = "holds" if result["holds"] else "does not hold"
    lines.append(f"\n{result['requests']} requests, traffic seed {result['traffic_seed']}: the loop {verdict} "
                 f"(ratio {result['ratio']})")
    return "\n".join(lines)
