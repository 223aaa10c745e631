"""A callback that keeps the logs Keras hands every callback after each batch:
its own module, since tests/jax imports it too (there `conftest` names
tests/jax/conftest.py)."""

import keras


class BatchLogs(keras.callbacks.Callback):
    """The logs Keras hands every callback after each batch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(dict(logs))
