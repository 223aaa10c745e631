"""MP020 on TensorFlow for tests/keras_io/dtype_mix.py's layers (the JAX and
PyTorch twins: tests/jax/test_dtype_mix_jax.py, tests/torch/test_dtype_mix_torch.py).

TensorFlow's ops and the `+`, `*` and `@` of its tensors do not promote:
keras-io's VAE sampling pattern (Mul) and a float32 draw's matmul (MatMul)
raise in fit, where JAX and PyTorch promote; the layers casting their draw
train. (Its MatrixInverse has a float16 kernel: the Whitening layer trains.)
"""

from __future__ import annotations

import pytest
from dtype_mix import DrawnNoise, fit, matmul_operator, sampling
from keras_io_checks import codes as _codes
from keras_io_checks import only as _only


@pytest.mark.parametrize(("combine", "op"), [(sampling, "Mul"), (matmul_operator, "MatMul")])
def test_float32_draws_beside_float16_are_mixed_floats_on_tensorflow(tmp_path, combine, op):
    square = combine is matmul_operator
    run, raised, _ = fit(tmp_path / "published", DrawnNoise, combine, square=square)
    assert isinstance(raised, TypeError)
    finding = _only(run, "MP020")
    assert finding.step == 0 and finding.evidence["kind"] == "mixed_floats"
    assert finding.evidence["op"] == op
    assert "keras.ops.cast(x, self.compute_dtype)" in finding.fix
    assert "TensorFlow's ops and the +, * and @ of its tensors do not promote" in finding.fix
    assert _codes(run) == {"MP020", "MP011"}
    healthy, raised, _ = fit(tmp_path / "healthy", DrawnNoise, combine, square=square,
                             cast=True)
    assert raised is None and _codes(healthy) == {"MP011"}
