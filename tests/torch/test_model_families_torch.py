"""The real-model suite on PyTorch: the same families (tests/models/model_families.py)
and the same checks (tests/models/model_suite.py) as on TensorFlow and JAX,
each fitted once under mixed_float16 with numerics on every step.

All run in float16 on PyTorch's CPU: the families are small enough that its
slow float16 kernels cost little (measured on 2 busy cores: MobileNetV3's
profiled fit ~4 s in mixed_float16, ~3 s in mixed_bfloat16, every other
family under 0.5 s either way). Unlike JAX's CPU, PyTorch's runs float16
attention.

On PyTorch a recurrent layer runs its cell in a Python loop over the time
steps (Keras' `torch` backend `rnn`): the cell is called once per step, so the
checks expect it measured at its RNN's boundary and listed as skipped, as on
TensorFlow and JAX.
"""

import keras
import pytest
from model_families import FAMILIES
from model_suite import run_family


@pytest.fixture(autouse=True)
def _mixed_float16():
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy("mixed_float16")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family(tmp_path, capsys, name):
    run_family(FAMILIES[name](), tmp_path, capsys)
