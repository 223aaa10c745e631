"""Checks shared by the real-model suite: fit a model under the profiler, then
compare what mpprof recorded with what the model itself says.

The expected inventory and numerics rows are computed here from Keras' own
view of each layer (`compute_dtype`, `variable_dtype`, `dtype_policy`,
sublayers), not from mpprof's code, so that a wrong record cannot agree with
itself.
"""

from __future__ import annotations

import collections
import json

import keras
from batch_logs import BatchLogs

import mpprof
from mpprof import cli
from mpprof.records import reader, schema

# What every finding of `mpprof diagnose --format json` carries (README).
FINDING_KEYS = {"code", "severity", "title", "layer", "step", "evidence", "fix"}


def fit_profiled(model, x, y=None, *, logdir, **fit_kwargs) -> reader.Run:
    """`model.fit` with a profiler sampling numerics on every step; the run
    read back. Every callback saw the step's own logs, each a number."""
    profiler = mpprof.MixedPrecisionProfiler(str(logdir), numerics_every=1, gpu_interval=None)
    batch_logs = BatchLogs()
    fit_kwargs.setdefault("epochs", 1)
    model.fit(x, y, verbose=0, callbacks=[profiler, batch_logs], **fit_kwargs)
    assert batch_logs.seen
    for logs in batch_logs.seen:
        assert not any(name.startswith("_mpprof") for name in logs), logs
        assert all(isinstance(value, float) for value in logs.values()), logs
    return reader.read_run(logdir, schema.TRAIN_RUN)


def nested_layers(model) -> list:
    """Every layer nested in `model` (InputLayers aside), each once."""
    found = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if not isinstance(layer, keras.layers.InputLayer):
            found.setdefault(id(layer), layer)
    return list(found.values())


def sublayers(layer) -> list:
    return [
        child for child in layer._flatten_layers(include_self=False, recursive=False)
        if not isinstance(child, keras.layers.InputLayer)
    ]


def assert_inventory_matches(run: reader.Run, model) -> dict[str, dict]:
    """The recorded inventory lists each of the model's layers once, with its
    class and dtypes; every leaf was seen called. Returns records by name."""
    inventory = run.inventory
    assert inventory is not None, "no inventory recorded"
    recorded = inventory["layers"]

    def key(name, cls, compute, variable):
        return name.rsplit("/", 1)[-1], cls, compute, variable

    expected = collections.Counter(
        key(layer.name, type(layer).__name__, layer.compute_dtype, layer.variable_dtype)
        for layer in nested_layers(model)
    )
    found = collections.Counter(
        key(r["name"], r["class"], r["compute_dtype"], r["variable_dtype"]) for r in recorded
    )
    assert found == expected, (
        f"missing or wrong: {expected - found}; unexpected: {found - expected}"
    )
    by_name = {r["name"]: r for r in recorded}
    assert len(by_name) == len(recorded), "a layer name is recorded twice"
    # Policy names where the policy is one per layer (a DTypePolicyMap
    # resolves per layer path: its test checks those itself).
    policies = collections.Counter(
        (layer.name, layer.dtype_policy.name) for layer in nested_layers(model)
        if not isinstance(layer.dtype_policy, keras.dtype_policies.DTypePolicyMap)
    )
    found_policies = collections.Counter(
        (r["name"].rsplit("/", 1)[-1], r["policy"]) for r in recorded
    )
    assert not policies - found_policies, f"wrong policies: {policies - found_policies}"
    assert inventory["model"]["policy"] == model.dtype_policy.name
    return by_name


def expected_skipped(model) -> dict[str, str]:
    """The layers numerics cannot measure, from Keras' own view: every layer
    nested in a recurrent layer (`keras.layers.RNN`) runs inside its loop
    (a TensorFlow while loop, JAX's lax.scan, PyTorch's Python loop over the
    time steps), so it is measured at the
    boundary of the nearest one. Qualified name -> that RNN's name."""
    found = {}

    def visit(layer, path, rnn):
        for child in sublayers(layer):
            name = f"{path}/{child.name}" if path else child.name
            if rnn is not None:
                found[name] = rnn
            visit(child, name, name if isinstance(child, keras.layers.RNN) else rnn)

    visit(model, "", None)
    return found


def assert_skipped_as_expected(run: reader.Run, model) -> list[dict]:
    """The numerics layout lists exactly the layers `expected_skipped` names,
    each with the recurrent layer measured instead."""
    skipped = run.latest(schema.NUMERICS_LAYOUT)["skipped"]
    assert {s["layer"]: s["measured_at"] for s in skipped} == expected_skipped(model)
    assert all("runs inside the recurrent layer" in s["reason"] for s in skipped), skipped
    return skipped


def expected_numerics_rows(model) -> collections.Counter:
    """Short names of the layers whose numerics should be recorded: every leaf
    layer, but a recurrent layer's cell runs inside the RNN's loop: the RNN
    layer itself is measured instead."""
    rows = collections.Counter()

    def visit(layer):
        if isinstance(layer, keras.layers.RNN) or not sublayers(layer):
            rows[layer.name] += 1
            return
        for child in sublayers(layer):
            visit(child)

    for layer in sublayers(model):
        visit(layer)
    return rows


def assert_numerics_recorded(run: reader.Run, model, inventory: dict[str, dict]) -> list[str]:
    """Samples were recorded for the expected layers: each layer called in the
    step has a measured output, each layer with trainable weights a measured
    incoming gradient, each trainable variable a measured gradient. Returns
    the measured layers' names."""
    numerics = run.numerics
    assert numerics is not None and len(numerics.steps) >= 1, "no numerics sample recorded"
    rows = collections.Counter(name.rsplit("/", 1)[-1] for name in numerics.layers)
    assert rows == expected_numerics_rows(model)
    assert numerics.variables == [v.path for v in model.trainable_variables]
    for row, name in enumerate(numerics.layers):
        if inventory[name]["call_index"] is None:
            continue  # never called in the step (MultiHeadAttention's fused softmax)
        assert (numerics.forward["count"][:, row] > 0).all(), f"{name}: no forward stats"
    trainable = {name for name in numerics.layers if _layer_at(model, name).trainable_weights}
    for row, name in enumerate(numerics.layers):
        if name in trainable:
            assert (numerics.backward["count"][:, row] > 0).all(), f"{name}: no gradient stats"
    assert (numerics.variable_grads["count"] > 0).all()
    return list(numerics.layers)


def _layer_at(model, qualified_name: str):
    layer = model
    for part in qualified_name.split("/"):
        layer = next(child for child in sublayers(layer) if child.name == part)
    return layer


def diagnose_json(logdir, capsys) -> list[dict]:
    """`mpprof diagnose LOGDIR --format json`: valid JSON findings, no warnings."""
    capsys.readouterr()
    code = cli.main(["diagnose", str(logdir), "--format", "json"])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    assert err == "", err
    findings = json.loads(out)
    assert isinstance(findings, list)
    for finding in findings:
        assert FINDING_KEYS <= set(finding), finding
    return findings


def check_model(run: reader.Run, model, logdir, capsys) -> dict:
    """All of the suite's checks; returns what was measured, for messages."""
    inventory = assert_inventory_matches(run, model)
    measured = assert_numerics_recorded(run, model, inventory)
    skipped = assert_skipped_as_expected(run, model)
    findings = diagnose_json(logdir, capsys)
    return {"layers": len(inventory), "measured": measured, "skipped": skipped,
            "codes": sorted({f["code"] for f in findings})}


def run_family(family, logdir, capsys) -> dict:
    """Fits a `model_families.Family` under the profiler, applies every
    check of the suite and the family's own; returns `check_model`'s summary."""
    run = fit_profiled(family.model, family.x, family.y, logdir=logdir, **family.fit_kwargs)
    summary = check_model(run, family.model, logdir, capsys)
    if family.check is not None:
        family.check(run, summary)
    return summary
