"""Which Keras a model belongs to: the one fact every backend and the chooser ask."""

from __future__ import annotations

import sys

# The flavours, as `Backend.flavor` and the run context name them.
KERAS_3 = "keras"
TF_KERAS = "tf_keras"


def is_tf_keras(model) -> bool:
    """Whether `model` is a tf-keras (Keras 2) model. tf-keras is looked up,
    never imported: such a model exists only once its user imported it."""
    tf_keras = sys.modules.get("tf_keras")
    return tf_keras is not None and isinstance(model, tf_keras.Model)
