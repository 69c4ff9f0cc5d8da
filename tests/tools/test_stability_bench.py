"""The stability benchmark's counting (benchmarks/stability.py): swings, zigzags, late dips."""

from __future__ import annotations

import pytest

from benchmarks.stability import grpo_config, late_dips, reached, swings


def test_swings_count_large_moves_and_the_ones_that_come_straight_back() -> None:
    # Problem 0: certain, then half (a swing), then back (a swing, the first one's zigzag), then
    # a small move. Problem 1 never moves by more than SWING.
    p = [[1.0, 0.5], [0.5, 0.55], [0.95, 0.6], [0.9, 0.6]]
    assert swings(p, 0) == (2, 1)
    # Counting from step 2 leaves only the move back, with nothing after it in the same way.
    assert swings(p, 2) == (1, 0)
    assert swings([[0.5]] * 5, 0) == (0, 0)


def test_late_dips_count_evaluations_under_the_best_before_them() -> None:
    curve = [(10, 0.5), (20, 0.9), (30, 0.8), (40, 0.88), (50, 0.9)]
    assert late_dips(curve, 0) == 1  # 0.8 is more than 0.05 under 0.9; 0.88 is not
    assert late_dips(curve, 30) == 0  # only evaluations after step 30 count


def test_reached_is_the_first_evaluation_at_the_mark() -> None:
    assert reached([(10, 0.5), (20, 0.91), (30, 0.8), (40, 0.95)]) == 20
    assert reached([(10, 0.5)]) is None


def test_a_bad_grpo_table_stops_before_any_run() -> None:
    cfg = grpo_config({"lr": 7e-4})  # a valid table passes, over the recipe's KL term
    assert (cfg.lr, cfg.kl_coef) == (7e-4, 0.2)
    with pytest.raises(SystemExit, match="lrr"):
        grpo_config({"lrr": 1})
    with pytest.raises(SystemExit, match="JSON object"):
        grpo_config([1])
