"""A profiled fit that overflows on every step, to be stopped from outside.

Usage: python hard_stop_fit.py LOG_DIR PROGRESS_FILE [--own-sigterm-handler MARKER]
           [--steps N] [--hold-at STEP GO_FILE]

Every step's float16 forward pass overflows, so every step is skipped and is
one overflow event. After each step the script appends "<steps done>
<time.time()>" to PROGRESS_FILE, so a test that kills it knows which steps
had run by when. With --own-sigterm-handler the script installs a SIGTERM
handler of its own first, which writes MARKER and exits 0: mpprof's handler
must run before it and hand the signal on to it. --steps ends the fit after N
steps (default 100,000); --hold-at waits after step STEP until GO_FILE exists
(a test changes the world there: a store that stops answering).
"""

import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras
import numpy as np

import mpprof

FLUSH_EVERY_SECONDS = 1.0


class Progress(keras.callbacks.Callback):
    def __init__(self, path: str, hold_at: int | None = None, go_file: str | None = None):
        super().__init__()
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the fit
        self._done = 0
        self._hold_at, self._go_file = hold_at, go_file

    def on_train_batch_end(self, batch, logs=None):
        self._done += 1
        self._file.write(f"{self._done} {time.time()}\n")
        if self._done == self._hold_at:
            while not os.path.exists(self._go_file):
                time.sleep(0.05)


def main() -> None:
    log_dir, progress = sys.argv[1], sys.argv[2]
    if "--own-sigterm-handler" in sys.argv:
        marker = sys.argv[sys.argv.index("--own-sigterm-handler") + 1]

        def own_handler(signum, frame):
            with open(marker, "w") as f:
                f.write("handled")
            os._exit(0)

        signal.signal(signal.SIGTERM, own_handler)
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((4,)),
        keras.layers.Dense(16, kernel_initializer=keras.initializers.Constant(300.0)),
        keras.layers.Dense(16, kernel_initializer=keras.initializers.Constant(300.0)),
        keras.layers.Dense(1, dtype="float32"),
    ])
    model.compile(optimizer="sgd", loss="mse")
    # One long epoch: epoch ends flush too, and must not be what saves records.
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 100_000
    hold_at = go_file = None
    if "--hold-at" in sys.argv:
        at = sys.argv.index("--hold-at")
        hold_at, go_file = int(sys.argv[at + 1]), sys.argv[at + 2]
    x = np.ones((4 * steps, 4), np.float32)
    y = np.ones((4 * steps, 1), np.float32)
    profiler = mpprof.MixedPrecisionProfiler(
        log_dir, numerics_every=None, gpu_interval=None,
        flush_every_steps=100_000, flush_every_seconds=FLUSH_EVERY_SECONDS,
    )
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False,
              callbacks=[profiler, Progress(progress, hold_at, go_file)])


if __name__ == "__main__":
    main()
