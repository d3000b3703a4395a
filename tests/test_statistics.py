"""Confidence intervals and paired tests against hand-computed values."""

from __future__ import annotations

import math

import pytest

from fedfm_flower.study.statistics import mean_ci, paired_test

T_975 = {2: 4.302652729749464, 29: 2.045229642132703}  # Student-t quantiles (tables)


def test_mean_ci_is_the_student_t_interval() -> None:
    values = [94.0, 95.5, 96.1]
    mean, half = mean_ci(values)
    sd = math.sqrt(sum((v - 95.2) ** 2 for v in values) / 2)
    assert mean == pytest.approx(95.2)
    assert half == pytest.approx(T_975[2] * sd / math.sqrt(3))
    assert mean_ci([3.0]) == (3.0, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        mean_ci([])


def test_paired_test_matches_the_t_statistic_of_the_differences() -> None:
    a = [0.5 + 0.1 * (i % 7) + 0.02 * i for i in range(30)]
    b = [x - 0.03 - 0.01 * (i % 3) for i, x in enumerate(a)]
    test = paired_test(a, b)
    d = [x - y for x, y in zip(a, b, strict=True)]
    mean = sum(d) / 30
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 29)
    assert test.n == 30
    assert test.mean_difference == pytest.approx(mean)
    assert test.ci_half_width == pytest.approx(T_975[29] * sd / math.sqrt(30))
    assert test.significant() and test.p_value < 1e-10  # t = mean / (sd / sqrt 30) ~ 20


def test_paired_test_sees_no_difference_in_noise_and_refuses_bad_input() -> None:
    a = [1.0, 2.0, 3.0, 4.0]
    b = [1.1, 1.9, 3.1, 3.9]  # differences -0.1, 0.1, -0.1, 0.1: mean 0
    test = paired_test(a, b)
    assert test.mean_difference == pytest.approx(0.0, abs=1e-12)
    assert not test.significant() and test.p_value > 0.9
    assert paired_test([1.0, 2.0], [1.0, 2.0]).p_value == 1.0
    with pytest.raises(ValueError, match="equal-length"):
        paired_test([1.0, 2.0], [1.0])


def test_values_that_are_not_finite_are_refused_not_averaged() -> None:
    with pytest.raises(ValueError, match="finite"):
        mean_ci([1.0, math.nan, 2.0])
    with pytest.raises(ValueError, match="finite"):
        paired_test([1.0, 2.0, math.inf], [1.0, 2.0, 3.0])
