"""Runs written before the run context's keys were framework-neutral still
read, and are judged, as they were: `tensorflow_version` /
`gpus_visible_to_tensorflow` (TensorFlow), `jax_version`, `jaxlib_version`
/ `gpus_visible_to_jax` (JAX), now `framework` and `gpus_visible`."""

import copy

import pytest
from diagnosis_runs import read, rewritten

from mpprof import diagnosis
from mpprof.records import reader

OLD_KEYS = {
    "TensorFlow": {"tensorflow_version": "2.15.0", "gpus_visible_to_tensorflow": 0},
    "JAX": {"jax_version": "0.4.30", "jaxlib_version": "0.4.31", "gpus_visible_to_jax": 0},
}


def with_context(tmp_path, context: dict) -> reader.Run:
    """The healthy mixed_float16 CPU run, its run context replaced by `context`."""
    rewritten(read("healthy_mixed"), tmp_path / "train", context).close()
    return reader.read_run(str(tmp_path), "train")


def old_format(framework: str) -> dict:
    context = copy.deepcopy(read("healthy_mixed").context.record)
    del context["framework"], context["gpus_visible"]
    # Old runs without NVML facts: the framework's GPU count alone said CPU.
    del context["hardware"]
    context.update(OLD_KEYS[framework])
    return context


@pytest.mark.parametrize("framework", sorted(OLD_KEYS))
def test_an_old_run_reads_its_framework_and_gpus(tmp_path, framework):
    run = with_context(tmp_path, old_format(framework))
    assert not run.warnings
    versions = OLD_KEYS[framework]
    assert run.context.framework["name"] == framework
    assert run.context.framework["version"] == next(iter(versions.values()))
    assert run.context.gpus_visible == 0
    assert run.context.versions.startswith(f"{framework} {next(iter(versions.values()))}, ")
    # The CPU finding still fires from the old count alone.
    found = {f.code: f for f in diagnosis.diagnose(run)}
    assert found["MP011"].evidence["cpu_only"] is True


def test_a_new_run_reads_the_same_from_its_neutral_keys(tmp_path):
    context = read("healthy_mixed").context
    assert context.framework["name"] == "TensorFlow"
    assert context.record["gpus_visible"] == context.gpus_visible == 0
    assert not any("tensorflow" in key or "jax" in key for key in context.record)


def test_a_run_that_says_nothing_of_gpus_is_not_called_cpu_only(tmp_path):
    """The look-alike that must not fire: no GPU count, no hardware facts."""
    context = old_format("TensorFlow")
    del context["gpus_visible_to_tensorflow"]
    run = with_context(tmp_path, context)
    assert run.context.gpus_visible is None
    assert "MP011" not in {f.code for f in diagnosis.diagnose(run)}
