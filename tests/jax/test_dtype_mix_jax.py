"""MP020 on JAX: what its fits raise (or do instead) for the dtype mistakes a
mixed policy brings out (tests/keras_io/dtype_mix.py's layers).

jax.numpy, keras.ops and the `+`, `*` and `@` of JAX arrays promote float16
with float32 to float32: keras-io's VAE sampling pattern and a float32 draw's
matmul train, no MP020. jax.lax does not promote (a layer calling
`jax.lax.add` raises) and `linalg.inv` has no float16 CPU kernel: those fits
raise, and MP020 says so with JAX's reason, not TensorFlow's.
"""

from __future__ import annotations

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "keras_io"))
from dtype_mix import DrawnNoise, check_no_half_kernel, fit, matmul_operator, sampling
from keras_io_checks import codes as _codes
from keras_io_checks import only as _only


def test_a_float32_draw_added_by_jax_lax_is_mixed_floats_on_jax(tmp_path):
    run, raised, caught = fit(tmp_path / "published", DrawnNoise, jax.lax.add)
    assert isinstance(raised, TypeError)
    assert "lax.add requires arguments to have the same dtypes" in str(raised)
    finding = _only(run, "MP020")
    assert finding.step == 0 and finding.evidence["kind"] == "mixed_floats"
    assert finding.evidence["op"] == "lax.add"
    assert "keras.ops.cast(x, self.compute_dtype)" in finding.fix
    assert "jax.lax ops do not promote dtypes" in finding.fix
    assert "TensorFlow" not in finding.fix
    assert _codes(run) == {"MP020", "MP011"}
    assert not [w for w in caught if "training goes on" in str(w.message)]
    # The healthy look-alike: the same layer casting its draw trains.
    healthy, raised, _ = fit(tmp_path / "healthy", DrawnNoise, jax.lax.add, cast=True)
    assert raised is None and _codes(healthy) == {"MP011"}


@pytest.mark.parametrize("combine", [sampling, matmul_operator])
def test_float32_draws_promote_and_train_on_jax(tmp_path, combine):
    """TensorFlow raises on both (Mul, MatMul of float16 and float32); JAX promotes."""
    run, raised, _ = fit(tmp_path, DrawnNoise, combine, square=combine is matmul_operator)
    assert raised is None
    assert "MP020" not in _codes(run)


def test_an_op_without_a_float16_cpu_kernel_is_no_half_kernel_on_jax(tmp_path):
    finding, raised = check_no_half_kernel(tmp_path)
    assert "Unsupported dtype float16" in str(raised)
    assert "op" not in finding.evidence  # JAX's message names none
    assert finding.fix.startswith("JAX has no float16 kernel for an op of the step")
