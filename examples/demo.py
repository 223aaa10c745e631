"""`make demo`: train a healthy model and a faulty one, diagnose, fix, check;
then the faulty one again on Keras 3's JAX backend; then the precision
advisor's verified plan for the faulty one.

Runs each step as its own process and prints the command before its output,
so the transcript shows what to type yourself. TensorFlow's C++ log lines
(absl's, printed on import even with TF_CPP_MIN_LOG_LEVEL=3) are dropped from
the children's stderr; everything else they print is passed through.

    python examples/demo.py --log-dir logs
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

RUNS = ("mnist_mixed_float16", "attention_overflow", "attention_fixed",
        "attention_overflow_jax")
# absl's "before InitializeLog" notice and its glog-style lines
# ("I0000 00:00:1796416302.191610    4722 cudart_stub.cc:31] ...").
TF_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\)"
    r"|[IWEF]\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w.]+:\d+\])"
)


def run(*command: str, backend: str | None = None) -> None:
    """Runs one step, echoing it; exits with its status if it fails.
    `backend` sets KERAS_BACKEND for it."""
    shown = [Path(command[0]).name, *command[1:]]
    if backend:
        shown.insert(0, f"KERAS_BACKEND={backend}")
    print(f"$ {' '.join(shown)}", flush=True)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1"}
    if backend:
        env["KERAS_BACKEND"] = backend
    # The plain CPU kernels: oneDNN emulates float16 (see the Makefile).
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    process = subprocess.Popen(command, env=env, stdout=None, stderr=subprocess.PIPE,
                               text=True, errors="replace")
    for line in process.stderr:
        if not TF_NOISE.match(line):
            sys.stderr.write(line)
    if process.wait():
        sys.exit(process.returncode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default="logs")
    parser.add_argument("--port", default="6006", help="where `make demo` serves TensorBoard")
    args = parser.parse_args()
    logdir = Path(args.log_dir)
    for name in RUNS:
        shutil.rmtree(logdir / name, ignore_errors=True)
    python = sys.executable
    mpprof = str(Path(python).with_name("mpprof"))
    if not Path(mpprof).exists():
        mpprof = "mpprof"

    print("1. Train the seed model and one whose Attention layer overflows float16")
    run(python, "examples/mnist_mixed_float16.py", "--verbose", "0",
        "--log-dir", str(logdir / "mnist_mixed_float16"))
    run(python, "examples/attention_overflow.py", "--verbose", "0",
        "--log-dir", str(logdir / "attention_overflow"))
    print("\n2. Diagnose: the first layer that overflowed, replayed op by op to a fix, verified"
          " (close to float32 on the step, and a short trial that trains like float32)")
    run(mpprof, "diagnose", str(logdir / "attention_overflow"), "--replay")
    print("\n3. Train again with the fix (Attention in float32 via a DTypePolicyMap), diagnose")
    run(python, "examples/attention_overflow.py", "--verbose", "0", "--fix",
        "--log-dir", str(logdir / "attention_fixed"))
    run(mpprof, "diagnose", str(logdir / "attention_fixed"))
    print("\n4. The faulty model on Keras 3's JAX backend: the same finding, replayed"
          " through the step's jaxpr")
    run(python, "examples/attention_overflow.py", "--verbose", "0",
        "--log-dir", str(logdir / "attention_overflow_jax"), backend="jax")
    run(mpprof, "diagnose", str(logdir / "attention_overflow_jax"), "--replay")
    print("\n5. The precision advisor: which layers must be float32, which can go lower,"
          " verified on the run's own batches, and the speed it buys on an H100")
    run(mpprof, "advise", str(logdir / "attention_overflow"), "--verify", "--gpu", "H100")
    run(mpprof, "report", str(logdir), "-o", str(logdir / "report.html"), "--quiet")
    print(f"\nNext: the mpprof tab in TensorBoard (tensorboard --logdir {logdir}, "
          f"http://127.0.0.1:{args.port}/#mpprof),\n"
          f"      the offline report {logdir / 'report.html'}, "
          "and docs/ (make docs) for what each finding means.")


if __name__ == "__main__":
    main()
