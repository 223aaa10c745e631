"""The real-model suite on JAX: the same families (tests/models/model_families.py)
and the same checks (tests/models/model_suite.py) as on TensorFlow, each
fitted once under the profiler with numerics on every step.

On JAX a recurrent layer runs its cell inside `lax.scan`: the checks expect
the RNN measured at its boundary and its cells listed as skipped with
`measured_at`, as on TensorFlow.
"""

import jax
import keras
import pytest
from model_families import FAMILIES
from model_suite import run_family

# Keras' own failure on XLA:CPU, without mpprof too: under mixed_float16,
# MultiHeadAttention's JAX `dot_product_attention` asks for float32 logits
# from float16 query and key (`preferred_element_type`), a dot_general
# precision XLA:CPU does not lower in the jitted train step. On CPU these
# families run under mixed_bfloat16 (which it lowers) instead.
FLOAT16_ATTENTION_FAILS_ON_CPU = ("transformer_block", "vit_backbone")


@pytest.fixture(autouse=True)
def _mixed_float16():
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy("mixed_float16")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family(tmp_path, capsys, name):
    if name in FLOAT16_ATTENTION_FAILS_ON_CPU and jax.default_backend() == "cpu":
        keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    run_family(FAMILIES[name](), tmp_path, capsys)


def test_keras_fails_float16_attention_on_cpu_without_mpprof():
    """Why the families above run under mixed_bfloat16 on CPU: Keras' own fit,
    no profiler, fails there. When this stops failing, run them in float16."""
    family = FAMILIES["transformer_block"]()
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(
            ValueError, match="'F16_F16_F32' is not supported by dot_general on CPU"):
        family.model.fit(family.x, family.y, verbose=0, **family.fit_kwargs)
