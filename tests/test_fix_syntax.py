"""Each backend's code in fixes speaks only its own framework
(`mpprof.fix_syntax`): the rules' texts on real runs are tested
with their rules (tests/torch/test_custom_step_torch.py, the MP010 and
MP018 tests of tests/test_diagnosis.py, tests/jax/test_keras_io_jax.py)."""

from __future__ import annotations

import dataclasses

import pytest

from mpprof.backends import REGISTRY, TF_KERAS, load
from mpprof.fix_syntax import FixSyntax, Spelling

# What only one framework's code says.
OWN = {
    "tensorflow": ("tf.", "GradientTape"),
    "jax": ("jax.", "stateless_apply", "StatelessScope"),
    "torch": ("torch", ".backward()", "zero_grad"),
}
ROWS = [  # (keras_flavor, keras_backend) -> the framework its code speaks
    (("keras", "tensorflow"), "tensorflow"),
    (("keras", None), "tensorflow"),  # runs written before other backends
    (("tf_keras", "tensorflow"), "tensorflow"),
    (("keras", "jax"), "jax"),
    (("keras", "torch"), "torch"),
]


@pytest.mark.parametrize(("run", "framework"), ROWS)
def test_the_code_of_a_train_step_and_of_bounded_inputs_is_the_backend_s(run, framework):
    syntax = FixSyntax(*run)
    code = "\n".join([syntax.custom_step(), syntax.scaled_step, syntax.float_promotion,
                      *syntax.scale_inputs("1 / 65535")])
    assert all(word in syntax.custom_step() for word in OWN[framework][:2])
    foreign = [word for other, words in OWN.items() if other != framework
               for word in words if word in code]
    assert foreign == [], code


def test_tf_keras_spells_its_own_module_and_steps():
    syntax = FixSyntax("tf_keras", "tensorflow")
    rescaling, pipeline = syntax.scale_inputs("1 / 65535")
    assert rescaling.startswith('tf_keras.layers.Rescaling(1 / 65535, dtype="float32")')
    assert pipeline.startswith("dataset = dataset.map(lambda x, y: (tf.cast(x, tf.float32)")
    assert "get_scaled_loss" in syntax.custom_step() and "get_unscaled_gradients" in (
        syntax.scaled_step)
    assert syntax.framework == "TensorFlow and tf-keras"


def test_an_unknown_backend_is_spelled_as_tensorflow():
    assert FixSyntax("keras", "mlx").custom_step() == FixSyntax("keras", None).custom_step()
    assert FixSyntax("keras", "mlx").backend == "tensorflow"


@pytest.mark.parametrize("registered", [*REGISTRY.values(), TF_KERAS],
                         ids=[*REGISTRY, "tf_keras"])
def test_every_registered_backend_spells_every_field(registered):
    """A backend's fixes are spelled by its own row: a registration names
    one, and it fills every field (`compile_step` None only where the backend
    always compiles its step, as JAX does)."""
    spelling = load(registered.fix_spelling)
    assert isinstance(spelling, Spelling)
    values = {field.name: getattr(spelling, field.name) for field in dataclasses.fields(Spelling)}
    assert [name for name, value in values.items() if value == ""] == []
    assert [name for name, value in values.items() if value is None] in ([], ["compile_step"])
    assert "{optimizer}" in spelling.custom_step and "{scale}" in spelling.scale_inputs
