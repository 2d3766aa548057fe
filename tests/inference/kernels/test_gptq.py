"""GPTQ (``inference.kernels.gptq``) against round-to-nearest, same storage format.

Inputs with unequal feature scales and correlated features (what norms and
earlier layers give real activations) are where GPTQ's error feedback pays:
here its output error ``||X (W - Q)^T|| / ||X W^T||`` is ~0.79x RTN's
(measured 0.0050 vs 0.0064 and 0.0051 vs 0.0065, int8, two seeds). With isotropic inputs (``H`` ~ a multiple
of the identity) the feedback has nothing to exploit, which is why it does
not beat RTN on the random Llama of test_quant_quality.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from inference.kernels.gptq import gptq_quantize, hessian


def _inputs(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    mix = np.eye(k) + rng.standard_normal((k, k)) / np.sqrt(k)
    return rng.standard_normal((n, k)) @ mix * rng.uniform(0.1, 3.0, k)


def _rtn(w: np.ndarray) -> np.ndarray:
    s = np.abs(w).max(1, keepdims=True) / 127
    return np.clip(np.round(w / s), -127, 127) * s


@pytest.mark.parametrize("seed", [0, 1])
def test_gptq_lowers_the_output_error_in_the_same_format(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, w = _inputs(rng, 2048, 128), rng.standard_normal((64, 128)) / 11
    codes, scale = gptq_quantize(w, hessian(x), "int8")
    assert np.array_equal(codes, np.round(codes)) and np.abs(codes).max() <= 127
    np.testing.assert_allclose(scale, np.abs(w).max(1) / 127, rtol=1e-6)  # RTN's scales
    err = {name: np.linalg.norm(x @ (w - q).T) / np.linalg.norm(x @ w.T)
           for name, q in (("rtn", _rtn(w)), ("gptq", codes * scale[:, None]))}
    assert err["gptq"] < 0.85 * err["rtn"]


def test_dead_inputs_get_zero_weight_and_shapes_are_checked() -> None:
    rng = np.random.default_rng(2)
    x = _inputs(rng, 512, 32)
    x[:, 5] = 0.0
    codes, _ = gptq_quantize(rng.standard_normal((8, 32)), hessian(x), "fp8")
    assert (codes[:, 5] == 0).all()
    with pytest.raises(ValueError, match="do not match"):
        gptq_quantize(np.zeros((8, 32)), np.eye(16))
