"""`perpetua bench learner`: the warm ratio and the cold per-cycle cost are computed from their
two measured sides, and both sides did the same work (the same batch, the same updates)."""

import statistics

from ops.bench.learner import run_bench


def test_learner_bench_ratios_come_from_the_measured_sides():
    r = run_bench(groups=4, group_size=4, micro_batch_size=8, rounds=2, warmup=1, cold_updates=2)
    base, cand, cold = r["baseline"], r["candidate"], r["cold"]
    assert len(base["seconds_all"]) == len(cand["seconds_all"]) == 2
    recomputed = statistics.median(b / c for b, c in zip(base["seconds_all"], cand["seconds_all"]))
    assert abs(r["ratio"] - recomputed) < 2e-3  # the reported seconds are rounded to 0.1 ms
    # The same tokens per update on both sides: tokens/s x seconds agree.
    tokens = r["setup"]["tokens_per_update"]
    for side in (base, cand):
        assert abs(side["tokens_per_s"] * side["seconds_per_update"] - tokens) <= 0.01 * tokens
    # Cold: one whole learner process did the two updates; its ratio is the bare loop's compute
    # for those updates over the process's wall time, and a cold step costs more than its compute.
    assert cold["updates"] == 2
    assert abs(cold["bare_loop_compute_seconds"] - 2 * base["seconds_per_update"]) < 0.01
    assert abs(cold["ratio"] - cold["bare_loop_compute_seconds"] / cold["wall_seconds"]) < 1e-3  # figures are rounded
    assert 0 < cold["ratio"] < 1
    assert set(cold["phase_seconds"]) >= {"read_inputs", "model_build_and_load", "train", "save_and_export"}
    assert cold["peak_rss_mb"] > 100 and r["peak_rss_mb"]["warm_process"] > 100
