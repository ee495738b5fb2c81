"""The incremental harvester: exactly once across runs, restarts and concurrent runs; bad records
quarantined with reasons; conservation; dedup by task signature; and `perpetua harvest`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ops.harvest import classify, harvester
from ops.harvest.classify import ConservationError, HarvestCounts
from ops.harvest.failures import failures_version, read_failures
from ops.harvest.harvester import HarvestConfig, harvest
from ops.common.paths import home
from ops.tasks.task_world import generate_tasks, normalize_question
from ops.harvest.contract import TRACES, TRACES_JSON, write_traces

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = HarvestConfig(known_model_versions=frozenset({"1", "2"}), max_record_bytes=2048)
TASKS = generate_tasks("sub_words", 40, seed=3)


def rec(i: int, outcome: str = "failure", task=None, **overrides) -> dict:
    t = task or TASKS[i % len(TASKS)]
    r = {
        "trace_id": f"tr-{i}",
        "timestamp": f"2025-01-01T00:00:{i % 60:02d}Z",
        "model_version": "1" if i % 2 else "2",
        "family": t.family,
        "question": t.question,
        "messages": [{"role": "user", "content": t.question}, {"role": "assistant", "content": f"CALL calc({t.expression})"}],
        "tool_calls": [{"name": "calc", "arguments": t.expression, "result": t.answer}],
        "final_answer": t.answer if outcome == "success" else "-1",
        "finish_reason": "answer",
        "outcome": outcome,
        "task": {"task_id": t.task_id, "expression": t.expression},
    }
    r.update(overrides)
    return r


def lines(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


def test_harvesting_twice_harvests_nothing_new(perpetua_home):
    landing = home().landing
    write_traces([rec(i, "failure" if i % 3 else "success") for i in range(30)], landing)
    write_traces([rec(i, "error", error_type="TimeoutError", final_answer=None) for i in range(30, 40)], landing, format="parquet")
    first = harvest(SETTINGS)
    assert first.counts.to_dict() == {
        "read": 40, "harvested": 30, "duplicates": 0, "successes_skipped": 10, "quarantined": 0, "quarantine_reasons": {},
    }
    assert first.generation == 1 and first.counts.conserved
    again = harvest(SETTINGS)
    assert again.counts.read == 0 and again.generation == 1 and again.data_version == first.data_version
    # a new file repeating old traces: read, but only as duplicates
    write_traces([rec(5), rec(6), rec(100)], landing)
    third = harvest(SETTINGS)
    assert (third.counts.read, third.counts.harvested, third.counts.duplicates) == (3, 1, 2)
    failures = read_failures()
    all_ids = [tid for ids in failures["trace_ids"].to_pylist() for tid in ids]
    assert len(all_ids) == len(set(all_ids)) == 31
    assert failures["n_traces"].to_pylist() == [len(ids) for ids in failures["trace_ids"].to_pylist()]


def test_every_kind_of_bad_record_is_quarantined_with_its_reason(perpetua_home):
    good = [rec(i) for i in range(6)]
    no_question = {k: v for k, v in rec(50).items() if k != "question"}
    bad = [
        b"{this is not json",
        b"[1, 2, 3]",
        json.dumps(no_question).encode(),
        rec(51, trace_id=51),
        rec(52, model_version="99"),
        rec(53, outcome="sideways"),
        rec(54, timestamp="last tuesday"),
        rec(55, question="x" * 5000),
        rec(56, messages=[{"role": "robot", "content": "beep"}]),
        rec(57, timestamp="2025-02-30T00:00:00Z"),
        b'{"trace_id": "a"} {"trace_id": "b"}',
        b"",  # blank lines are not records
    ]
    (home().landing / "mixed.jsonl").write_bytes(lines(*good[:3], *bad, *good[3:]))
    result = harvest(SETTINGS)
    c = result.counts
    assert c.quarantine_reasons == {
        "malformed_json": 2,
        "not_an_object": 1,
        "missing_field:question": 1,
        "wrong_type:trace_id": 1,
        "unknown_model_version": 1,
        "invalid_value:outcome": 1,
        "invalid_value:timestamp": 2,
        "oversized": 1,
        "invalid_value:messages.role": 1,
    }
    assert (c.read, c.harvested, c.quarantined) == (17, 6, 11) and c.conserved
    entries = [json.loads(x) for x in result.quarantine_path.read_text().splitlines()]
    assert {e["source_file"] for e in entries} == {"mixed.jsonl"}
    by_line = {e["line"]: e for e in entries}
    assert by_line[4]["reason"] == "malformed_json" and by_line[4]["raw"] == "{this is not json"
    assert by_line[8]["reason"] == "unknown_model_version" and '"99"' in by_line[8]["raw"]
    assert by_line[11]["reason"] == "oversized"


def test_traces_of_another_environment_are_quarantined_with_the_reason(perpetua_home):
    """A home trains one environment: a trace naming it (or none) is harvested, one naming another
    registered environment is `environment_mismatch`, one naming no registered one
    `unknown_environment`; nothing is dropped."""
    records = [rec(0), rec(1, environment="calculator"), rec(2, environment="reasoning_gym"),
               rec(3, environment="my_unregistered_env"), rec(4, environment="")]
    (home().landing / "envs.jsonl").write_bytes(lines(*records))
    result = harvest(SETTINGS)
    c = result.counts
    assert c.quarantine_reasons == {"environment_mismatch": 1, "unknown_environment": 1, "invalid_value:environment": 1}
    assert c.harvested == 2 and c.conserved
    entries = {json.loads(x)["line"]: json.loads(x)["reason"] for x in result.quarantine_path.read_text().splitlines()}
    assert entries == {3: "environment_mismatch", 4: "unknown_environment", 5: "invalid_value:environment"}


def test_vectorised_and_per_record_validation_agree(tmp_path, monkeypatch):
    """The fast path decides the same as the per-record path (the single source of truth)."""
    rows = []
    for i in range(400):
        kind = i % 13
        r = rec(i, ("failure", "success", "error")[i % 3])
        if kind == 1:
            r["model_version"] = "7"
        elif kind == 2:
            r["feedback"] = {"rating": "negative"}
        elif kind == 3:
            r["messages"] = [None]
        elif kind == 4:
            r["usage"] = {"prompt_tokens": 3}
        elif kind == 5:
            r["tool_calls"] = [{"name": "", "arguments": "1"}]
        elif kind == 6:
            r["trace_id"] = f"tr-{i - 6}"  # duplicate
        elif kind == 7:
            r["feedback"] = {}
        elif kind == 8:
            r["tool_calls"][0]["error"] = "syntax error"
        elif kind == 9:
            r["family"] = ""
        elif kind == 10:
            r["usage"] = {"prompt_tokens": 1.5, "completion_tokens": 1}
        elif kind == 11:
            r["finish_reason"] = "invalid_action"
        rows.append(r)
    arrow_rows = []  # the same defects as a Parquet file (rows Arrow can represent), new ids
    for r in rows:
        try:
            pa.Table.from_pylist([r], schema=TRACES_JSON)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            continue
        arrow_rows.append({**r, "trace_id": "pq-" + str(r["trace_id"])})
    tables = []
    for name, row_only in (("fast", False), ("slow", True)):
        monkeypatch.setenv("PERPETUA_HOME", str(tmp_path / name))
        h = home().ensure()
        (h.landing / "a.jsonl").write_bytes(lines(*rows[:200]))
        (h.landing / "b.jsonl").write_bytes(lines(*rows[200:]))
        pq.write_table(pa.Table.from_pylist(arrow_rows, schema=TRACES_JSON), h.landing / "c.parquet")
        result = harvest(SETTINGS.model_copy(update={"row_validation_only": row_only}))
        tables.append((result.counts.to_dict(), result.data_version, read_failures()))
    (fast_counts, fast_version, fast), (slow_counts, slow_version, slow) = tables
    assert fast_counts == slow_counts and fast_version == slow_version and fast.equals(slow), (fast_counts, slow_counts)
    assert fast_counts["quarantined"] > 100 and fast_counts["duplicates"] > 0 and fast_counts["harvested"] > 50


def test_compacting_failures_in_memory_changes_nothing(tmp_path, monkeypatch):
    rows = [rec(i, "failure" if i % 4 else "error", error_type="E") for i in range(300)]
    versions = []
    for name, compact in (("plain", 10**9), ("compact", 7)):
        monkeypatch.setattr(classify, "COMPACT_ROWS", compact)
        monkeypatch.setenv("PERPETUA_HOME", str(tmp_path / name))
        for k in range(3):
            (home().ensure().landing / f"f{k}.jsonl").write_bytes(lines(*rows[100 * k : 100 * (k + 1)]))
        result = harvest(SETTINGS.model_copy(update={"block_bytes": 8192}))
        versions.append((result.data_version, result.failure_types, result.families))
    assert versions[0] == versions[1] and versions[0][1] == {"error:E": 75, "wrong_answer": 225}


def test_parquet_landing_files_are_validated_too(perpetua_home):
    rows = [rec(i) for i in range(8)]
    rows[1]["model_version"] = "99"
    rows[2]["question"] = None
    rows[3]["outcome"] = "maybe"
    table = pa.Table.from_pylist(
        [{**r, "timestamp": None if i == 4 else __import__("datetime").datetime(2025, 1, 1)} for i, r in enumerate(rows)],
        schema=TRACES,
    )
    pq.write_table(table, home().landing / "typed.parquet")
    # otherwise valid rows whose trace ids are integers: Arrow could cast them, the contract does not
    ints = table.slice(5, 2).set_column(1, "trace_id", pa.array([1, 2]))
    pq.write_table(ints, home().landing / "wrong.parquet")
    (home().landing / "broken.parquet").write_bytes(b"PAR1 not really")
    (home().landing / "notes.txt").write_text("not a trace file")
    result = harvest(SETTINGS)
    assert result.counts.quarantine_reasons == {
        "unknown_model_version": 1,
        "missing_field:question": 1,
        "invalid_value:outcome": 1,
        "missing_field:timestamp": 1,
        "wrong_type:trace_id": 2,
        "unreadable_file": 1,
    }
    assert result.counts.harvested == 4 and result.counts.conserved
    assert result.skipped_files == ["notes.txt"]


def test_failures_dedup_by_signature_and_are_labelled(perpetua_home):
    t = TASKS[0]
    shouty = "  " + t.question.upper().replace(" ", "   ") + " "
    records = [
        rec(1, task=t),  # wrong answer
        rec(2, task=t, question=shouty, final_answer=None),  # no answer, same signature
        rec(3, task=TASKS[1], outcome="error", error_type="TimeoutError"),
        rec(4, task=TASKS[2], tool_calls=[{"name": "calc", "arguments": "1/0", "error": "unsupported"}]),
        rec(5, task=TASKS[3], finish_reason="invalid_action", final_answer=None),
        rec(6, task=TASKS[4], outcome="success", feedback={"rating": "negative"}),
        rec(7, task=TASKS[5], outcome="success", feedback={"rating": "positive"}),
    ]
    write_traces(records, home().landing)
    result = harvest(SETTINGS)
    assert (result.counts.harvested, result.counts.successes_skipped) == (6, 1)
    failures = {r["signature"]: r for r in read_failures().to_pylist()}
    row = failures[normalize_question(t.question)]
    assert row["trace_ids"] == ["tr-1", "tr-2"] and row["n_traces"] == 2
    assert row["failure_types"] == ["no_answer", "wrong_answer"] and row["failure_type"] == "no_answer"
    assert row["task_id"] == t.task_id and row["question"] == t.question and row["expression_hint"] == t.expression
    types = {r["trace_ids"][0]: r["failure_type"] for r in failures.values()}
    assert types == {"tr-1": "no_answer", "tr-3": "error:TimeoutError", "tr-4": "tool_error", "tr-5": "invalid_format", "tr-6": "negative_feedback"}
    assert result.failure_types == {"error:TimeoutError": 1, "invalid_format": 1, "negative_feedback": 1, "no_answer": 1, "tool_error": 1, "wrong_answer": 1}


def test_appended_jsonl_and_long_lines_are_read_from_the_offset(perpetua_home):
    path = home().landing / "stream.jsonl"
    path.write_bytes(lines(rec(1), rec(2)))
    settings = SETTINGS.model_copy(update={"block_bytes": 4096, "max_record_bytes": 1024})
    assert harvest(settings).counts.harvested == 2
    with open(path, "ab") as f:
        f.write(lines(rec(3, question="y" * 10_000), rec(4)))  # longer than a whole block
    second = harvest(settings)
    assert (second.counts.read, second.counts.harvested, second.counts.quarantine_reasons) == (2, 1, {"oversized": 1})
    entry = json.loads(second.quarantine_path.read_text())
    assert entry["line"] == 3 and entry["raw"].startswith('{"trace_id": "tr-3"')


def test_a_crash_before_the_commit_is_redone_not_doubled(perpetua_home, monkeypatch):
    write_traces([rec(i) for i in range(10)], home().landing)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(harvester, "write_cursor", crash)  # the commit point
    with pytest.raises(OSError):
        harvest(SETTINGS)
    monkeypatch.undo()
    monkeypatch.setenv("PERPETUA_HOME", str(perpetua_home))
    result = harvest(SETTINGS)
    assert result.generation == 1 and result.counts.harvested == 10
    assert sum(read_failures()["n_traces"].to_pylist()) == 10


def test_concurrent_harvests_take_each_trace_once(perpetua_home):
    for k in range(4):
        write_traces([rec(100 * k + i) for i in range(50)], home().landing)
    code = (
        "import json; from ops.harvest.harvester import harvest, HarvestConfig; "
        "r = harvest(HarvestConfig(known_model_versions=frozenset({'1', '2'}))); print(json.dumps(r.counts.to_dict()))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT) for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o["read"] for o in outs) == [0, 200] and sum(o["harvested"] for o in outs) == 200
    assert sum(read_failures()["n_traces"].to_pylist()) == 200


def test_conservation_is_checked():
    counts = HarvestCounts(read=5, harvested=2, duplicates=1, successes_skipped=1, quarantined=0)
    assert not counts.conserved
    with pytest.raises(ConservationError):
        counts.check()
    HarvestCounts(read=3, harvested=1, quarantined=2, quarantine_reasons={"oversized": 2}).check()


def test_cli_harvest_runs_through_dagster(perpetua_home, monkeypatch, capsys):
    from dagster import DagsterInstance

    from pipelines.cli import main

    monkeypatch.setenv("DAGSTER_HOME", str(perpetua_home / "dagster"))  # restored after the test
    write_traces([rec(i) for i in range(5)] + [rec(9, model_version="42")], home().landing)
    assert main(["harvest", "--json", "--known-version", "1", "--known-version", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {k: out[k] for k in ("read", "harvested", "duplicates", "successes_skipped", "quarantined", "quarantine_reasons")} == {
        "read": 6, "harvested": 5, "duplicates": 0, "successes_skipped": 0, "quarantined": 1,
        "quarantine_reasons": {"unknown_model_version": 1},
    }
    instance = DagsterInstance.get()
    run = instance.get_run_by_id(out["dagster_run_id"])
    assert run.job_name == "harvest" and run.is_success
    event = instance.get_latest_materialization_event(__import__("dagster").AssetKey("harvested_failures"))
    assert event.asset_materialization.tags["dagster/data_version"] == pq_hash(out["failures_table"])
    assert "dagster/input_data_version/production_traces" in event.asset_materialization.tags  # observed in the same run
    assert main(["harvest", "--known-version", "1"]) == 0
    assert "read                         0" in capsys.readouterr().out
    assert main(["harvest", "--known-version", " "]) == 2  # a user mistake: one line, no traceback
    assert "--known-version" in capsys.readouterr().err


def pq_hash(path: str) -> str:
    return failures_version(pq.read_table(path))


def test_bench_small():
    from ops.bench.harvest import run_bench

    result = run_bench(n=20_000, malformed_n=0, threaded_baseline=False)
    assert result["name"] == "harvest" and result["ratio"] > 0
    cand, base = result["candidate"], result["baseline"]
    assert base["records"] == cand["records"] == 20_000 and cand["conserved"]
    assert cand["counts"]["quarantined"] == sum(v for k, v in result["written"].items() if k not in ("good", "duplicate"))
    assert set(cand["counts"]["quarantine_reasons"]) >= {"oversized", "unknown_model_version", "missing_field:family"}
    assert cand["peak_rss_mb"] > 0 and base["peak_rss_mb"] > 0


# ---- exact under appends, misconfiguration and bad files ----------------------------------------


def _cursor_bytes() -> bytes | None:
    path = home().data / "harvest" / "cursor.json"
    return path.read_bytes() if path.exists() else None


def test_a_line_being_appended_waits_for_the_next_harvest(perpetua_home):
    path = home().landing / "live.jsonl"
    whole = lines(rec(1), rec(2), rec(3), rec(4))
    half = whole.index(b"\n", whole.index(b"\n") + 1) + 1 + 40  # two lines and 40 bytes of the third
    path.write_bytes(whole[:half])
    first = harvest(SETTINGS)
    assert (first.counts.read, first.counts.harvested, first.counts.quarantined) == (2, 2, 0)
    with open(path, "ab") as f:
        f.write(whole[half:])  # the writer finishes the line and writes one more
    second = harvest(SETTINGS)
    assert (second.counts.read, second.counts.harvested, second.counts.quarantined) == (2, 2, 0)
    assert second.quarantine_path is None and first.quarantine_path is None
    table = read_failures()
    assert sorted(t for ids in table["trace_ids"].to_pylist() for t in ids) == ["tr-1", "tr-2", "tr-3", "tr-4"]
    assert harvest(SETTINGS).counts.read == 0


def test_an_unterminated_last_line_is_final_once_the_file_is_quiet(perpetua_home):
    path = home().landing / "died.jsonl"
    path.write_bytes(lines(rec(1)) + json.dumps(rec(2)).encode() + lines(rec(3))[:30])  # a writer died mid-line
    assert harvest(SETTINGS).counts.read == 1  # just written: the tail may still be coming
    old = path.stat().st_mtime - 3600
    os.utime(path, (old, old))
    later = harvest(SETTINGS.model_copy(update={"quiet_seconds": 60}))
    assert (later.counts.read, later.counts.harvested, later.counts.quarantined) == (1, 0, 1)
    assert later.counts.quarantine_reasons == {"malformed_json": 1} and later.counts.conserved


def test_no_known_model_version_fails_and_keeps_everything(perpetua_home):
    from ops.harvest.harvester import HarvestError

    none = HarvestConfig(known_model_versions=frozenset())
    assert harvest(none).counts.read == 0  # nothing landed: nothing to refuse
    write_traces([rec(i) for i in range(5)], home().landing)
    before = _cursor_bytes()
    landed = {p.name: p.read_bytes() for p in home().landing.iterdir()}
    with pytest.raises(HarvestError, match=r"^no model version is known.*1 landing file\(s\) with unread records") as e:
        harvest(none)
    assert "\n" not in str(e.value)
    assert _cursor_bytes() == before and list(home().quarantine.iterdir()) == []
    assert {p.name: p.read_bytes() for p in home().landing.iterdir()} == landed
    assert harvest(SETTINGS).counts.harvested == 5  # once a version is known, nothing was lost


def test_the_asset_reports_no_known_version_in_one_line(perpetua_home, monkeypatch):
    import dagster as dg

    from assets.harvested_failures import harvested_failures
    from assets.resources import MlflowTracking

    monkeypatch.setenv("PERPETUA_KNOWN_MODEL_VERSIONS", "")
    write_traces([rec(1)], home().landing)
    with dg.instance_for_test() as instance:
        result = dg.materialize([harvested_failures], instance=instance, raise_on_error=False, resources={"mlflow": MlflowTracking()})
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure).step_failure_data.error
    assert "no model version is known" in failure.message and "\n" not in failure.message.strip()


def test_symlinks_and_special_files_are_refused_unread(perpetua_home):
    landing = home().landing
    write_traces([rec(1)], landing)
    (landing / "passwd.jsonl").symlink_to("/etc/passwd")
    (landing / "etc").symlink_to("/etc", target_is_directory=True)
    os.mkfifo(landing / "pipe.jsonl")  # opening it for reading would block
    result = harvest(SETTINGS)
    c = result.counts
    assert (c.read, c.harvested, c.quarantined) == (4, 1, 3) and c.conserved
    assert c.quarantine_reasons == {"not_a_regular_file": 3}
    assert result.refused_files == ["etc", "passwd.jsonl", "pipe.jsonl"]
    quarantined = result.quarantine_path.read_text()
    assert "root:" not in quarantined and Path("/etc/passwd").read_text()[:20] not in quarantined
    assert {json.loads(line)["raw"] for line in quarantined.splitlines()} == {"symlink: refused, not read",
                                                                              "fifo: refused, not read"}
    again = harvest(SETTINGS)  # refused once, not counted again
    assert again.counts.read == 0


def test_a_landing_file_swapped_for_a_symlink_is_not_followed(perpetua_home, monkeypatch):
    from ops.harvest import landing as landing_mod

    path = home().landing / "swapped.jsonl"
    path.write_bytes(lines(rec(1)))
    listed = landing_mod.landing_files(home().landing)
    path.unlink()
    path.symlink_to("/etc/passwd")  # after the listing, before the read
    monkeypatch.setattr(harvester, "landing_files", lambda _: listed)
    result = harvest(SETTINGS)
    assert result.counts.quarantine_reasons == {"not_a_regular_file": 1} and result.refused_files == ["swapped.jsonl"]
    assert "root:" not in result.quarantine_path.read_text()
    monkeypatch.undo()
    monkeypatch.setenv("PERPETUA_HOME", str(perpetua_home))
    assert harvest(SETTINGS).counts.read == 0  # the symlink is now listed as refused: not counted twice


def test_a_parquet_row_group_too_large_for_its_rows_is_rejected_undecoded(perpetua_home, monkeypatch):
    from ops.harvest import parquet_source

    path = home().landing / "groups.parquet"
    from ops.harvest.contract import TraceRecord

    def table(rows):
        return pa.Table.from_pylist([TraceRecord.model_validate(r).model_dump() for r in rows], schema=TRACES)

    with pq.ParquetWriter(path, TRACES) as w:
        w.write_table(table([rec(i) for i in range(3)]))
        # 6 kB of distinct text per row (no dictionary shrinks it), limit 2 kB
        w.write_table(table([rec(i, question=f"{i}-" + "q" * 6000) for i in range(3, 7)]))
    assert pq.ParquetFile(path).metadata.num_row_groups == 2
    decoded = []
    original = parquet_source._harvest_rows
    monkeypatch.setattr(parquet_source, "_harvest_rows", lambda t, *a: (decoded.append(t.num_rows), original(t, *a)))
    result = harvest(SETTINGS)
    c = result.counts
    assert decoded == [3]  # the second row group was never decoded
    assert (c.read, c.harvested, c.quarantined, c.quarantine_reasons) == (7, 3, 4, {"oversized_row_group": 4})
    assert c.conserved
    entry = json.loads(result.quarantine_path.read_text())
    assert entry["rows"] == 4 and entry["line"] == 4 and "not decoded" in entry["raw"] and "qqqq" not in entry["raw"]
    assert harvest(SETTINGS).counts.read == 0


def test_appends_cut_anywhere_harvest_every_record_once(perpetua_home):
    """Blocks smaller than the file, cuts inside lines and at block edges: appending piece by
    piece harvests each record once and quarantines nothing."""
    path = home().landing / "pieces.jsonl"
    whole = lines(*[rec(i, question=f"{TASKS[i % len(TASKS)].question}") for i in range(40)])
    settings = SETTINGS.model_copy(update={"block_bytes": 4096})
    cuts = sorted({len(whole) * k // 7 + k for k in range(1, 7)} | {4096, 4097, 8191})
    done, start = 0, 0
    for cut in [*cuts, len(whole)]:
        with open(path, "ab") as f:
            f.write(whole[start:cut])
        start = cut
        c = harvest(settings).counts
        assert c.quarantined == 0 and c.conserved
        done += c.read
    assert done == 40
    assert sorted(t for ids in read_failures()["trace_ids"].to_pylist() for t in ids) == sorted(f"tr-{i}" for i in range(40)
                                                                                               if rec(i)["outcome"] == "failure")
