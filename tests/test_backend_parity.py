"""The same runs on TensorFlow, JAX and PyTorch give the same records and findings.

`tests/parity_runs.py` trains each Keras 3 scenario (a healthy run, a loss
scale that collapses, an overflow storm and its growth-probe look-alike, a
float16 head, no loss scaling, a non-finite loss, a forward overflow and its
float32-island look-alike, a gradient underflow and its scaled look-alike,
float8 layers that saturate or underflow and their healthy look-alike)
in one process per backend; here each scenario's summary (findings with
their layer and step, every rule's status, the loss-scale events, the loss
health, the per-layer numerics the findings rest on; for the forward
overflow, its capture replayed by the backend's engine: the first op's
layer, the float32 layers, the map and whether it is verified) must be equal
across the three, and the findings those the scenario was built to show.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)

EXPECTED = {
    "healthy": {"MP011"},
    "collapse": {"MP001", "MP002", "MP011"},
    "storm": {"MP002", "MP011"},
    "growth_probes": {"MP011"},
    "float16_head": {"MP006", "MP011"},
    "no_loss_scaling": {"MP008", "MP011"},
    "nan_loss": {"MP012"},
    "forward_overflow": {"MP003", "MP011"},
    "float32_island": {"MP004", "MP011"},
    "gradient_underflow": {"MP005", "MP011"},
    "gradient_scaled": {"MP011"},
    # (MP007 judges Tensor Core shapes on a GPU only: these run on a CPU.)
    "float8_saturating": {"MP015"},
    "float8_underflowing": {"MP016"},
    "float8_healthy": set(),
}


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    """Every backend's summaries, their processes run side by side."""
    processes = {}
    for backend in ("tensorflow", "jax", "torch"):
        out = tmp_path_factory.mktemp(backend)
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
        processes[backend] = (out, subprocess.Popen(
            [sys.executable, os.path.join(HERE, "parity_runs.py"), str(out)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    found = {}
    for backend, (out, process) in processes.items():
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output[-3000:]
        with open(out / "summaries.json") as f:
            found[backend] = json.load(f)
        assert found[backend].pop("backend") == backend
    return found


def _dated_as_on_tensorflow(jax: dict) -> dict:
    """JAX's summary with each forensic sample dated a step later: on JAX it
    is of the overflowed step itself (its kept batch: the host reads the
    alarm once the step is done), on TensorFlow of the step after it (read
    before the next call). The scenarios overflow on every step, with
    constant weights and batches: the values are the same."""
    moved = {step: step + 1 for step in jax.get("forensic_steps", [])}
    if not moved:
        return jax
    return {**jax, "forensic_steps": [moved[s] for s in jax["forensic_steps"]],
            "numerics_steps": [moved.get(s, s) for s in jax["numerics_steps"]],
            "findings": [[code, layer, moved.get(step, step)]
                         for code, layer, step in jax["findings"]]}


# Values PyTorch computes otherwise, and why: these scenarios start from
# random kernels (glorot), which torch's generator draws otherwise than
# TensorFlow's and JAX's (which agree), so their values differ (the
# constant-kernel scenarios' values are compared). Their findings, steps and
# statuses are compared all the same; their loss-scale events are checked
# against Keras' own variables on PyTorch (tests/torch/test_torch_backend.py).
_VALUES = ("overflows", "growths", "forward_abs_max", "forward_nonfinite",
           "backward_subnormal")
TORCH_DRAWS_OTHER_KERNELS = {name: _VALUES for name in (
    "growth_probes", "healthy", "float16_head", "nan_loss", "no_loss_scaling")}


# The numerics values of the scenarios that start from random kernels
# (glorot, seeded): each backend's generator draws its own, so the values of
# their samples (at the default's early steps) differ across every pair of
# backends; their sampled steps, findings and statuses are compared all the same.
NUMERICS_VALUES = ("forward_abs_max", "forward_nonfinite", "backward_subnormal")
RANDOM_KERNELS = ("healthy", "float16_head", "nan_loss", "no_loss_scaling")


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_every_backend_records_and_finds_the_same(summaries, scenario):
    tensorflow = summaries["tensorflow"][scenario]
    jax = _dated_as_on_tensorflow(summaries["jax"][scenario])
    # PyTorch's step runs eagerly: the host knows of an overflow as the step
    # returns, and samples the next step, as TensorFlow does.
    torch = summaries["torch"][scenario]
    assert {code for code, _, _ in tensorflow["findings"]} == EXPECTED[scenario]
    for key in sorted(set(tensorflow) | set(jax)):
        if not (scenario in RANDOM_KERNELS and key in NUMERICS_VALUES):
            assert tensorflow.get(key) == jax.get(key), (scenario, key)
    for key in sorted(set(tensorflow) | set(torch)):
        if key not in TORCH_DRAWS_OTHER_KERNELS.get(scenario, ()):
            assert tensorflow.get(key) == torch.get(key), (scenario, "torch", key)
