"""``benchmarks/prepare.py``'s combination of several launches of one path: every time from the fastest launch (so a
stage and the raw scatter it is compared with come from one launch), every memory peak the highest of any launch."""

from __future__ import annotations

import pytest

from .bench import load_benchmark

prepare = load_benchmark("prepare")


def _rank(rank, wall, distribute, scatter, anon, rss, hwm):
    return {"rank": rank, "wall_s": wall, "distribute_s": distribute, "raw_scatter_s": scatter,
            "raw_scatter_fresh_s": scatter * 2, "anon_peak_mib": anon, "rss_peak_mib": rss, "hwm_mib": hwm}


def test_times_come_from_the_launch_whose_slowest_rank_was_fastest_and_memory_from_the_worst():
    # launch A: rank 1 is slow (3.0 s), though rank 0 is the fastest of all; launch B: both ranks 2.5 s
    a = [_rank(0, 1.0, 0.40, 0.10, 100.0, 300.0, 310.0), _rank(1, 3.0, 0.90, 0.30, 50.0, 60.0, 70.0)]
    b = [_rank(0, 2.5, 0.50, 0.20, 120.0, 250.0, 260.0), _rank(1, 2.5, 0.55, 0.21, 40.0, 80.0, 65.0)]
    out = prepare.combine_launches([a, b])
    # every time of both ranks is launch B's: not rank 0's 1.0 s of launch A beside rank 1's of launch B
    assert [(r["wall_s"], r["distribute_s"], r["raw_scatter_s"], r["raw_scatter_fresh_s"]) for r in out] == [
        (2.5, 0.50, 0.20, 0.40), (2.5, 0.55, 0.21, 0.42)]
    # each rank's peaks are the highest of either launch, each figure on its own
    assert [(r["anon_peak_mib"], r["rss_peak_mib"], r["hwm_mib"]) for r in out] == [(120.0, 300.0, 310.0),
                                                                                    (50.0, 80.0, 70.0)]
    assert all(r["launches"] == 2 for r in out)
    assert a[0]["wall_s"] == 1.0 and "launches" not in a[0]  # the launches' own figures are left as they were


def test_one_launch_is_its_own_figures():
    a = [_rank(0, 1.0, 0.4, 0.1, 10.0, 20.0, 30.0)]
    assert prepare.combine_launches([a]) == [{**a[0], "launches": 1}]


def test_launches_with_different_ranks_are_refused():
    a = [_rank(0, 1.0, 0.4, 0.1, 10.0, 20.0, 30.0)]
    with pytest.raises(ValueError, match=r"same ranks \(got \[1, 2\] ranks\)"):
        prepare.combine_launches([a, a + a])
    with pytest.raises(ValueError, match="same ranks"):
        prepare.combine_launches([])
