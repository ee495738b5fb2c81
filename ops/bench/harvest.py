"""Benchmark: the harvester against a plain `pyarrow.dataset` scan of the same landing files.

`n` generated trace records (1% bad: missing fields, unknown model versions, invalid values,
bad timestamps, oversized records, duplicate ids) are written as JSONL into a temporary
landing zone. Each side runs in its own fresh Python process, timed around the work only:
- baseline: `pyarrow.dataset` over the files with the contract's JSON schema, scanning every
  batch single-threaded like the harvester (the multi-threaded scan is measured too, as
  `baseline.threaded`). It parses, nothing more: no validation, no quarantine, no dedup, no
  cursor.
- candidate: `ops.harvest.harvester.harvest` (single-threaded parse, vectorised validation, quarantine,
  dedup, failure aggregation, cursor commit).
ratio = candidate records/s / baseline records/s (> 1 would mean the harvester is faster;
it is expected below 1 since it does far more). Wall seconds on a shared machine vary with its
load, so CPU seconds are reported beside them. Peak memory is the process's peak RSS
(VmHWM) and the Arrow memory pool's peak, both per side.

The bad kinds are those a plain scan can read (so the baseline sees the same files);
malformed JSON and wrong JSON types would make the baseline scan fail outright. They are
measured for the candidate alone, on a second landing zone (`candidate.with_malformed`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ops.tasks.task_world import FAMILIES, generate_tasks

KNOWN_VERSIONS = ("1", "2")
_PER_FILE = 100_000


def write_landing(landing: Path, n: int, *, malformed: bool = False, seed: int = 0) -> dict:
    """Write `n` records (1% bad) as JSONL files; returns what was written, by kind."""
    landing.mkdir(parents=True, exist_ok=True)
    tasks = [t for fam in FAMILIES for t in generate_tasks(fam, 200, seed)]
    bad_kinds = ["missing_field", "unknown_version", "invalid_outcome", "bad_timestamp", "oversized", "duplicate", "empty_id", "bad_role"]
    if malformed:
        bad_kinds += ["malformed_json", "wrong_type"]
    kinds: dict[str, int] = {"good": 0}
    big = "x" * 20_000
    lines: list[str] = []
    file_no = 0

    def flush() -> None:
        nonlocal lines, file_no
        if lines:
            tmp = landing / f".bench-{file_no:04d}.jsonl.tmp"
            tmp.write_text("\n".join(lines) + "\n")
            tmp.replace(landing / f"bench-{file_no:04d}.jsonl")
            lines, file_no = [], file_no + 1

    for i in range(n):
        t = tasks[i % len(tasks)]
        outcome = ("failure", "success", "success", "error")[i % 4]
        said = None if outcome == "error" else str(int(t.answer) + (outcome == "failure"))
        answer = "null" if said is None else f'"{said}"'
        said_text = said or ""
        kind = bad_kinds[(i // 100) % len(bad_kinds)] if i % 100 == 99 else "good"
        kinds[kind] = kinds.get(kind, 0) + 1
        tid = f"tr-{seed}-{i:09d}"
        version = KNOWN_VERSIONS[i % 2]
        ts = f"2025-01-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:00.{i % 1000:03d}Z"
        q, role = t.question, "assistant"
        if kind == "duplicate":
            tid = f"tr-{seed}-{i - 1:09d}"
        elif kind == "unknown_version":
            version = "999"
        elif kind == "bad_timestamp":
            ts = "yesterday"
        elif kind == "oversized":
            q = t.question + big
        elif kind == "empty_id":
            tid = ""
        elif kind == "bad_role":
            role = "robot"
        elif kind == "invalid_outcome":
            outcome = "maybe"
        line = (
            f'{{"schema_version":"1","trace_id":"{tid}","timestamp":"{ts}","model_version":"{version}",'
            f'"family":"{t.family}","question":"{q}",'
            f'"messages":[{{"role":"user","content":"{t.question}"}},{{"role":"{role}","content":"CALL calc({t.expression})"}},'
            f'{{"role":"tool","content":"RESULT {t.answer}"}},{{"role":"assistant","content":"ANSWER {said_text}"}}],'
            f'"tool_calls":[{{"name":"calc","arguments":"{t.expression}","result":"{t.answer}","error":null}}],'
            f'"final_answer":{answer},"finish_reason":"{"env_error" if outcome == "error" else "answer"}","outcome":"{outcome}",'
            f'"error_type":{"null" if outcome != "error" else chr(34) + "TimeoutError" + chr(34)},"feedback":null,'
            f'"usage":{{"prompt_tokens":{12 + i % 7},"completion_tokens":{20 + i % 11}}},"task":{{"task_id":"{t.task_id}","expression":"{t.expression}","answer":null}}}}'
        )
        if kind == "missing_field":
            line = line.replace(f'"family":"{t.family}",', "")
        elif kind == "malformed_json":
            line = line[: len(line) // 2]
        elif kind == "wrong_type":
            line = line.replace(f'"prompt_tokens":{12 + i % 7}', '"prompt_tokens":"many"')
        lines.append(line)
        if len(lines) >= _PER_FILE:
            flush()
    flush()
    return kinds


def _measure(side: str, landing: str, perpetua_home: str) -> dict:
    """Run one side in this process and return its timing and memory (called in a subprocess)."""
    import time

    import pyarrow as pa

    import pandas.util  # noqa: F401  (imports are not what is measured)
    import pyarrow.dataset as ds
    import pyarrow.json as pj

    from ops.harvest.harvester import HarvestConfig, harvest
    from ops.common.paths import Home
    from ops.harvest.contract import TRACES_JSON

    rss_before = _peak_rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    if side.startswith("baseline"):
        threads = side == "baseline_threaded"
        fmt = ds.JsonFileFormat(
            parse_options=pj.ParseOptions(explicit_schema=TRACES_JSON, unexpected_field_behavior="ignore"),
            read_options=pj.ReadOptions(block_size=8 << 20, use_threads=threads),
        )
        records = sum(b.num_rows for b in ds.dataset(landing, format=fmt).to_batches(use_threads=threads))
        extra: dict = {}
    else:
        result = harvest(HarvestConfig(known_model_versions=frozenset(KNOWN_VERSIONS), max_record_bytes=16 * 1024), Home(Path(perpetua_home)))
        records = result.counts.read
        extra = {"counts": result.counts.to_dict(), "conserved": result.counts.conserved, "signatures": result.n_signatures}
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "records": records,
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu, 3),
        "records_per_s": round(records / seconds, 1) if seconds > 0 else None,
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "rss_after_imports_mb": round(rss_before, 1),
        "arrow_peak_mb": round(pa.default_memory_pool().max_memory() / 2**20, 1),
        **extra,
    }


def _peak_rss_mb() -> float:
    """Peak RSS of this process. /proc's VmHWM starts afresh at exec; ru_maxrss on Linux keeps
    the forking parent's peak, so it is only the fallback."""
    from ops.bench.memory import vm_hwm_mb

    peak = vm_hwm_mb()
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run_side(side: str, landing: Path, perpetua_home: Path) -> dict:
    code = (
        "import json, sys; from ops.bench.harvest import _measure; "
        f"print(json.dumps(_measure({side!r}, {str(landing)!r}, {str(perpetua_home)!r})))"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench side {side} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_bench(n: int = 1_000_000, *, malformed_n: int | None = None, threaded_baseline: bool = True) -> dict:
    """Harvest `n` records vs a plain dataset scan of the same files (see module doc)."""
    malformed_n = max(1000, n // 10) if malformed_n is None else malformed_n
    tmp = Path(tempfile.mkdtemp(prefix="perpetua-bench-harvest-"))
    try:
        landing = tmp / "home" / "landing"  # the candidate's PERPETUA_HOME/landing; the baseline scans it too
        kinds = write_landing(landing, n)
        baseline = _run_side("baseline", landing, tmp / "unused")
        if threaded_baseline:
            baseline["threaded"] = _run_side("baseline_threaded", landing, tmp / "unused")
        candidate = _run_side("candidate", landing, tmp / "home")
        if malformed_n:
            landing2 = tmp / "home-malformed" / "landing"
            write_landing(landing2, malformed_n, malformed=True, seed=1)
            candidate["with_malformed"] = _run_side("candidate", landing2, tmp / "home-malformed")
        ratio = candidate["records_per_s"] / baseline["records_per_s"]
        return {
            "name": "harvest",
            "ratio": round(ratio, 4),
            "ratio_meaning": "harvester records/s / plain single-threaded pyarrow.dataset JSON scan records/s (>1: harvester faster)",
            "ratio_cpu": round(baseline["cpu_seconds"] / candidate["cpu_seconds"], 4) if candidate["cpu_seconds"] else None,
            "n": n,
            "written": kinds,
            "baseline": {"what": "pyarrow.dataset JSON scan with the contract schema, single-threaded", **baseline},
            "candidate": {"what": "ops.harvest.harvester.harvest: validate, quarantine, dedup, aggregate, commit", **candidate},
            "cpu_count": os.cpu_count(),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(run_bench(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000), indent=2))
