"""The one atomic-write mechanism (ops/common/atomic.py): files replaced whole, versioned
directories claimed by one writer and never published over another's."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from ops.common.atomic import ArtifactConflict, atomic_path, atomic_write_bytes, exclusive_dir, rename_noreplace


def test_a_file_is_replaced_whole_and_no_temporary_is_left(tmp_path):
    path = tmp_path / "cursor.json"
    atomic_write_bytes(path, b"old")
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["cursor.json"]
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("the writer failed")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["cursor.json"]


def test_rename_never_replaces_even_an_empty_directory(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("a")
    (tmp_path / "b").mkdir()
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a" / "f").read_text() == "a" and list((tmp_path / "b").iterdir()) == []


def _write_version(target: str, writer: str, started, go) -> str:
    try:
        with exclusive_dir(Path(target)) as partial:
            started.set()
            go.wait(30)
            (partial / "weights").write_text(writer * 1000)
            (partial / "writer").write_text(writer)
        return "won"
    except ArtifactConflict as e:
        return f"refused: {e}"


def _in_child(target: str, writer: str, started, go, out) -> None:
    out.put(_write_version(target, writer, started, go))


def test_two_processes_racing_for_one_version(tmp_path):
    target = tmp_path / "v0007" / "hf"
    ctx = mp.get_context("fork")
    started, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_in_child, args=(str(target), "a", started, go, out))
    child.start()
    try:
        assert started.wait(30)  # the first writer holds the claim and is writing
        second = _write_version(str(target), "b", ctx.Event(), ctx.Event())
        go.set()
        assert out.get(timeout=60) == "won"
    finally:
        child.join(30)
    assert second.startswith("refused:") and "another writer is writing it now" in second
    assert (target / "writer").read_text() == "a" and (target / "weights").read_text() == "a" * 1000
    late = _write_version(str(target), "c", ctx.Event(), ctx.Event())
    assert late.startswith("refused:") and "exists already" in late
    assert (target / "writer").read_text() == "a" and sorted(p.name for p in target.parent.iterdir()) == ["hf"]
