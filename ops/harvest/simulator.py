"""The production simulator: traffic against the served champion, written as production traces.

Production is the loop's source of new failures. Here it is simulated: a traffic generator
draws tasks from the environment (ops/envs; the calculator world by default) with a family mix
that drifts over production time t in [0, 1] (`Environment.production_mix(t)`: new families
appear and grow), every
request runs as a tool episode on the serving engine (the vLLM server, through
ops.rollout.server.ServerEngine: the same episode loop as training rollouts), is checked, and
becomes a trace record (ops.harvest.contract contract v1), where the harvester picks up the
failures: a file in PERPETUA_HOME/landing/, or an MLflow trace in the tracking store
(`ops.harvest.mlflow_sink`, as an agent instrumented with MLflow tracing logs its traffic). The failure rate per family over time is the production signal the
demo reports (drift families fail until training catches up).

The check is pluggable (`verify`); the default is the environment's production check
(`Environment.production_check`: by default the final answer against the task's ground truth). Requests go
out in waves of `wave_size` concurrent episodes, written when the wave
ends (one landing file per wave; traces appear while the simulation runs, as real traffic would).
"""

from __future__ import annotations

import random
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Callable

from pydantic import BaseModel, Field

from ops.envs import Environment, get_environment
from ops.tasks.task_world import Task
from ops.rollout.engine import PolicyVersionError, RolloutEngine
from ops.rollout.episodes import Episode, EpisodeRunner, EpisodeConfig
from ops.harvest.contract import TraceRecord, write_traces
from ops.harvest.mlflow_sink import MlflowTraceSink, TraceLogger

Verify = Callable[[Task, Episode], bool]


def production_check(env: Environment) -> Verify:
    """The default check: the environment's (`Environment.production_check`)."""
    return env.production_check


class SimulatorConfig(BaseModel):
    """One simulated stretch of production traffic."""

    requests: Annotated[int | None, Field(ge=1, description="Requests to send (None with a duration: as many as fit)")] = 64
    duration_s: Annotated[float | None, Field(gt=0, description="Wall seconds to run; production time t = elapsed / duration")] = None
    wave_size: Annotated[int, Field(ge=1, description="Concurrent episodes per wave (one landing file each)")] = 16
    seed: Annotated[int, Field(description="Traffic seed (families and operands)")] = 0
    temperature: Annotated[float, Field(ge=0, description="Serving temperature")] = 0.0
    top_p: Annotated[float, Field(gt=0, le=1, description="Serving nucleus mass")] = 1.0
    max_tokens: Annotated[int, Field(ge=1, description="Completion token budget per episode")] = 96
    windows: Annotated[int, Field(ge=1, description="Time windows of the failure-rate report")] = 4
    time_start: Annotated[float, Field(ge=0, le=1, description="Production time t at the first request")] = 0.0
    time_end: Annotated[float, Field(ge=0, le=1, description="Production time t at the last request")] = 1.0
    model_version: Annotated[str | None, Field(description="model_version written in traces (the registry version); default: the served policy version")] = None


@dataclass
class SimulationResult:
    records: list[TraceRecord]
    times: list[float]  # production time t of each record
    landing_files: list[Path]  # one per wave when traces go to the landing zone
    seconds: float
    model_version: str
    policy_version: int | None
    failure_rate: list[dict] = field(default_factory=list)
    by_family: dict[str, dict] = field(default_factory=dict)
    stopped_early: str | None = None  # why the run ended before its requests/duration
    traces_to: str = "landing"  # "landing", or "mlflow:<experiment>"

    def to_dict(self) -> dict:
        outcomes: dict[str, int] = defaultdict(int)
        for r in self.records:
            outcomes[r.outcome] += 1
        return {
            "requests": len(self.records),
            "seconds": round(self.seconds, 3),
            "model_version": self.model_version,
            "policy_version": self.policy_version,
            "traces_to": self.traces_to,
            "landing_files": [str(p) for p in self.landing_files],
            "outcomes": dict(outcomes),
            "failure_rate": self.failure_rate,
            "by_family": self.by_family,
            "stopped_early": self.stopped_early,
        }


VERSION_REREADS = 3  # a version reading that failed is read again this many times before the run stops


def _run_wave(runner: EpisodeRunner, engine: RolloutEngine, tasks: list[Task], settings: EpisodeConfig,
              policy_version: int, seeds: list[int], log: Callable[[str], None]) -> tuple[list, str | None]:
    """One wave's episodes, run to the end; or, when the served policy changed, why the run stops.

    Traces name one model version, so a deploy that refits the server mid-run ends the run. A
    reading of the version that failed (a slow or dropped /weight_info answer on a loaded machine)
    looks the same from one call: the version is read again, and when the server still serves
    the run's version the wave is sent again, from the same tasks and seeds."""
    attempt = 0
    while True:
        episodes = [runner.new_episode(task, 0, seed) for task, seed in zip(tasks, seeds)]
        try:
            runner.run(episodes, settings, require_version=policy_version)
            return episodes, None
        except PolicyVersionError as e:
            attempt += 1
            time.sleep(float(attempt))
            if attempt > VERSION_REREADS or engine.policy_version != policy_version:
                return episodes, f"the served policy changed: {e}"
            log(f"the served version read as changed ({e}), but the server still serves version {policy_version}: "
                "sending the wave again")


class Traffic:
    """Tasks as production sends them: family by the drifting mix, the task itself at random."""

    def __init__(self, seed: int, env: Environment | None = None) -> None:
        self.rng = random.Random(f"traffic:{seed}")
        self.seed = seed
        self.count = 0
        self.env = env or get_environment()

    def task_at(self, t: float) -> Task:
        mix = self.env.production_mix(t)
        family = self.rng.choices(list(mix), weights=list(mix.values()))[0]
        self.count += 1
        (task,) = self.env.generate_tasks(family, 1, seed=self.rng.getrandbits(31))
        return task


def run_simulation(
    engine: RolloutEngine,
    tokenizer,
    traces_to: Path | MlflowTraceSink,
    cfg: SimulatorConfig | None = None,
    *,
    verify: Verify | None = None,
    env: Environment | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> SimulationResult:
    """Send the traffic of environment `env`, write the traces (to a landing folder, or to MLflow),
    and report failure rates by family over time."""
    cfg = cfg or SimulatorConfig()
    env = env or get_environment()
    verify = verify or production_check(env)
    mlflow = TraceLogger(traces_to) if isinstance(traces_to, MlflowTraceSink) else None
    if cfg.requests is None and cfg.duration_s is None:
        raise ValueError("give a number of requests or a duration")
    policy_version = engine.check_version(None)
    model_version = cfg.model_version or str(policy_version)
    runner = EpisodeRunner(engine, tokenizer, env)
    settings = EpisodeConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=env.completion_budget(cfg.max_tokens))
    traffic = Traffic(cfg.seed, env)
    records, times, files = [], [], []
    start = time.monotonic()
    sent, stopped = 0, None
    while True:
        elapsed = time.monotonic() - start
        if cfg.requests is not None and sent >= cfg.requests:
            break
        if cfg.duration_s is not None and elapsed >= cfg.duration_s:
            break
        n = cfg.wave_size if cfg.requests is None else min(cfg.wave_size, cfg.requests - sent)
        wave_t = [_production_time(cfg, sent + i, elapsed) for i in range(n)]
        wave_start = datetime.now(timezone.utc)
        tasks = [traffic.task_at(t) for t in wave_t]
        episodes, stopped = _run_wave(runner, engine, tasks, settings, policy_version,
                                      [_episode_seed(cfg.seed, sent + i) for i in range(n)], log)
        if stopped:
            log(f"stopping: {stopped}")
            break
        wave = [trace_record(ep, model_version, verify, env) for ep in episodes]
        if mlflow is not None:
            wave = mlflow.log(wave, wave_start)
            where = f"{len(wave)} MLflow traces"
        else:
            files.append(write_traces(wave, traces_to, prefix="simulator"))
            where = files[-1].name
        records += wave
        times += wave_t
        sent += n
        fails = sum(r.outcome != "success" for r in wave)
        log(f"t={wave_t[0]:.2f}-{wave_t[-1]:.2f}: {n} requests, {fails} failed -> {where}")
    result = SimulationResult(records, times, files, time.monotonic() - start, model_version, policy_version,
                              stopped_early=stopped, traces_to="landing" if mlflow is None else f"mlflow:{traces_to.experiment}")
    result.failure_rate, result.by_family = failure_rates(records, times, cfg.windows, env)
    return result


def _production_time(cfg: SimulatorConfig, index: int, elapsed: float) -> float:
    if cfg.duration_s is not None:
        frac = min(1.0, elapsed / cfg.duration_s)
    else:
        frac = index / max(1, cfg.requests - 1)
    return cfg.time_start + (cfg.time_end - cfg.time_start) * frac


def _episode_seed(seed: int, index: int) -> int:
    return random.Random(f"episode:{seed}:{index}").getrandbits(31)


def trace_record(ep: Episode, model_version: str, verify: Verify, env: Environment | None = None) -> TraceRecord:
    """One episode as a production trace (ops.harvest.contract contract)."""
    env = env or get_environment()
    task = ep.task
    messages = [{"role": "user", "content": task.question}]
    calls = iter(ep.tool_calls)
    for line in ep.model_lines:
        messages.append({"role": "assistant", "content": line})
        if env.parse_action(line).kind == "call":
            call = next(calls, None)
            if call is not None:
                messages.append({"role": "tool", "content": call.result if call.error is None else f"error: {call.error}"})
    if ep.finish_reason in ("env_error", "engine_error"):
        outcome, error_type = "error", ep.finish_reason
    else:
        outcome, error_type = ("success" if verify(task, ep) else "failure"), None
    return TraceRecord(
        trace_id=uuid.uuid4().hex,
        timestamp=datetime.now(timezone.utc),
        model_version=model_version,
        family=task.family,
        question=task.question,
        messages=messages,
        tool_calls=[{"name": c.tool, "arguments": c.expression, "result": c.result, "error": c.error} for c in ep.tool_calls],
        final_answer=ep.final_answer,
        finish_reason=ep.finish_reason,
        outcome=outcome,
        error_type=error_type,
        usage={"prompt_tokens": len(ep.prompt_ids), "completion_tokens": ep.completion_tokens},
        task={"task_id": task.task_id, "expression": task.expression, "answer": task.answer},
        environment=env.name,
    )


def failure_rates(records: list[TraceRecord], times: list[float], windows: int,
                  env: Environment | None = None) -> tuple[list[dict], dict[str, dict]]:
    """Failure rate (outcome != success) per family, per window of production time, and overall."""
    cells: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r, t in zip(records, times):
        w = min(windows - 1, int(t * windows))
        failed = int(r.outcome != "success")
        for key, table in (((w, r.family), cells), (r.family, totals)):
            table[key][0] += 1
            table[key][1] += failed
    kind = {name: fam.kind for name, fam in (env or get_environment()).families.items()}
    rows = [
        {"window": w, "t_start": round(w / windows, 4), "t_end": round((w + 1) / windows, 4), "family": fam,
         "kind": kind.get(fam, "unknown"), "requests": n, "failures": f, "rate": round(f / n, 4)}
        for (w, fam), (n, f) in sorted(cells.items())
    ]  # fmt: skip
    by_family = {
        fam: {"kind": kind.get(fam, "unknown"), "requests": n, "failures": f, "rate": round(f / n, 4)}
        for fam, (n, f) in sorted(totals.items())
    }
    return rows, by_family


def format_report(result: SimulationResult) -> str:
    """A table: families as rows, time windows as columns, failure rate (requests) per cell."""
    windows = sorted({r["window"] for r in result.failure_rate})
    cell = {(r["family"], r["window"]): r for r in result.failure_rate}
    head = f"{'family':<12}{'kind':<10}" + "".join(f"t{w}".rjust(12) for w in windows) + "     overall"
    lines = [head]
    for fam, tot in result.by_family.items():
        cols = "".join(
            (f"{cell[fam, w]['rate']:.2f} ({cell[fam, w]['requests']})" if (fam, w) in cell else "-").rjust(12) for w in windows
        )
        lines.append(f"{fam:<12}{tot['kind']:<10}{cols}{tot['rate']:>8.2f} ({tot['requests']})")
    return "\n".join(lines)
