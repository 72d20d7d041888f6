import math

import numpy as np
import pytest

from jlora.values import is_integer, is_real


@pytest.mark.parametrize("value", [0, -3, 2**70, np.int8(1), np.uint32(7), np.int64(-1)])
def test_integers_python_and_numpy(value):
    assert is_integer(value) and is_real(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, np.float32(2), "1", None, [1], 1j])
def test_not_integers_bools_among_them(value):
    assert not is_integer(value)


@pytest.mark.parametrize("value", [0.5, -1e308, math.inf, math.nan, np.float16(1), np.float64(-2)])
def test_reals_inf_and_nan_included(value):
    assert is_real(value) and not is_integer(value)


@pytest.mark.parametrize("value", [True, np.bool_(False), "0.5", None, 1j, np.complex64(1)])
def test_not_reals(value):
    assert not is_real(value)
