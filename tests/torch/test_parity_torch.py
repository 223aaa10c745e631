"""tests/parity_runs.py's scenarios on PyTorch, in this process: each shows
the findings it was built to show (tests/test_backend_parity.py compares
their every record with TensorFlow's and JAX's, side by side), and the
facts the findings are dated by are PyTorch's own."""

from __future__ import annotations

import jax_runs
import parity_runs
import pytest
from test_backend_parity import EXPECTED


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    found = {}
    for name, (make, (x, y), profiler) in parity_runs._scenarios().items():
        run = jax_runs.fit(out / name, make(), x, y, **profiler)
        found[name] = parity_runs._summary(run, values=name not in parity_runs.FLOAT8)
    return found


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_each_scenario_shows_its_findings_on_torch(summaries, scenario):
    summary = summaries[scenario]
    assert {code for code, _, _ in summary["findings"]} == EXPECTED[scenario]


def test_findings_are_dated_by_the_torch_step(summaries):
    # The infinity is in batch 5; the first overflow is step 0 and its
    # forensic sample the next step's (step 1), where the layer that first
    # goes past float16 is "second".
    assert summaries["nan_loss"]["health"]["first_nonfinite_loss_step"] == 5
    assert ("MP003", "second", 1) in summaries["forward_overflow"]["findings"]
    assert summaries["forward_overflow"]["forensic_steps"] == [1]
    assert summaries["float32_island"]["forensic_steps"] == [1]
    assert not any(code == "MP003" for code, _, _ in summaries["float32_island"]["findings"])
