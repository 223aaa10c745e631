"""MP020 on PyTorch: what its fits raise (or do instead) for the dtype mistakes
a mixed policy brings out (tests/keras_io/dtype_mix.py's layers).

PyTorch promotes `+` and `*` (float16 with float32 gives float32): keras-io's
VAE sampling pattern trains, no MP020. Its matmul (`@`) does not promote and
`linalg.inv` has no float16 CPU kernel: those fits raise, and MP020 says so
with PyTorch's reason, not TensorFlow's.
"""

from __future__ import annotations

import traceback

import pytest
from dtype_mix import DrawnNoise, check_no_half_kernel, fit, matmul_operator, sampling
from keras_io_checks import codes as _codes
from keras_io_checks import only as _only


def test_a_float32_draw_matmuled_with_float16_is_mixed_floats_on_torch(tmp_path):
    run, raised, caught = fit(tmp_path / "published", DrawnNoise, matmul_operator, square=True)
    assert isinstance(raised, RuntimeError)
    assert "expected m1 and m2 to have the same dtype" in str(raised)
    finding = _only(run, "MP020")
    assert finding.step == 0 and finding.evidence["kind"] == "mixed_floats"
    assert "op" not in finding.evidence  # PyTorch's message names none
    assert "keras.ops.cast(x, self.compute_dtype)" in finding.fix
    assert "PyTorch promotes + and *, but its matrix products" in finding.fix
    assert "TensorFlow" not in finding.fix
    assert _codes(run) == {"MP020", "MP011"}
    assert not [w for w in caught if "training goes on" in str(w.message)]
    frames = [f.filename for f in traceback.extract_tb(raised.__traceback__)]
    assert not [f for f in frames if "/mpprof/" in f], frames
    # The healthy look-alike: the same layer casting its draw trains.
    healthy, raised, _ = fit(tmp_path / "healthy",
                             DrawnNoise, matmul_operator, square=True, cast=True)
    assert raised is None and _codes(healthy) == {"MP011"}


@pytest.mark.parametrize("cast", [False, True])
def test_the_vae_sampling_pattern_promotes_and_trains_on_torch(tmp_path, cast):
    """TensorFlow raises on it (Mul of float16 and float32); PyTorch promotes."""
    run, raised, _ = fit(tmp_path, DrawnNoise, sampling, cast=cast)
    assert raised is None
    assert "MP020" not in _codes(run)


def test_an_op_without_a_float16_cpu_kernel_is_no_half_kernel_on_torch(tmp_path):
    finding, raised = check_no_half_kernel(tmp_path)
    assert "Low precision dtypes not supported. Got Half" in str(raised)
    assert finding.evidence["op"] == "linalg.inv"
    assert finding.fix.startswith("PyTorch has no float16 kernel for the op linalg.inv")
