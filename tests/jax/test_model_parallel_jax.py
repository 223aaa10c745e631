"""keras.distribution.ModelParallel over two CPU devices: a LayoutMap shards
the first Dense kernel over a 'model' axis. Under the profiler `fit` works,
every overflow is recorded to the step (an unprofiled twin is the truth),
the weights end identical to the twin's, and the run context names the
distribution, its mesh, what it shards and what is not measured per device.

Runs in a subprocess: XLA_FLAGS must make two host devices before JAX starts.
"""

import textwrap

import jax_runs

MODEL_PARALLEL = textwrap.dedent("""
    import json, os, sys
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, keras
    sys.path.insert(0, sys.argv[2])
    import jax_runs

    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    # Keys are matched with re.fullmatch against each variable's path.
    layout_map[".*/dense/kernel"] = (None, "model")
    layout_map[".*/dense/bias"] = ("model",)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    x, y = jax_runs.ones(128, 1000.0)
    truth, profiled, run = jax_runs.fit_beside_a_twin(
        sys.argv[1], jax_runs.overflow_model, x, y, numerics_every=4)
    kernel = profiled.get_layer("dense").kernel
    print(json.dumps({
        "kernel_spec": [str(axis) for axis in kernel.value.sharding.spec],
        "kernel_shards": len(kernel.value.addressable_shards),
        "dense_paths": [v.path for v in profiled.get_layer("dense").weights],
        "truth": truth["overflows"], "recorded": run.loss_scale.overflow_steps.tolist(),
        "scales": [truth["scale"], run.loss_scale.final_scale],
        "same_weights": jax_runs.same_weights(truth["weights"], profiled),
        "samples": run.numerics.steps.tolist(), "measured": run.numerics.layers,
        "context": {key: run.context.get(key) for key in
                    ("distribution_strategy", "num_replicas", "distribution")},
        "state": run.context["collectors"]["numerics"]["state"],
    }))
""")


def test_model_parallel_fit_records_exactly_and_says_what_was_not_measured(tmp_path):
    found = jax_runs.run_script(MODEL_PARALLEL, tmp_path)
    # The layout took: the kernel lives in two shards, split on its units.
    assert found["kernel_spec"] == ["None", "model"] and found["kernel_shards"] == 2
    assert len(found["truth"]) > 5 and found["recorded"] == found["truth"]
    assert found["scales"][0] == found["scales"][1]
    assert found["same_weights"]
    assert found["state"] == "ok" and 4 in found["samples"]
    assert found["measured"] == ["dense", "dense_1"]
    context = found["context"]
    # One copy of the model (the mesh's batch axis is 1), split over 2 devices.
    assert context["distribution_strategy"] == "ModelParallel" and context["num_replicas"] == 1
    distribution = context["distribution"]
    assert distribution["name"] == "ModelParallel" and distribution["batch_dim_name"] == "batch"
    assert distribution["mesh"]["shape"] == [1, 2]
    assert distribution["mesh"]["axis_names"] == ["batch", "model"]
    assert len(distribution["mesh"]["devices"]) == 2
    kernel, bias = found["dense_paths"]
    assert distribution["sharded_variables"] == {kernel: [None, "model"], bias: ["model"]}
    assert any("per-device shards" in line for line in distribution["not_measured"])


def test_without_a_distribution_the_context_says_none(tmp_path):
    x, y = jax_runs.ones(16, 1.0)
    run = jax_runs.fit(tmp_path, jax_runs.overflow_model(), x, y)
    assert run.context["distribution"] is None
    assert (run.context["distribution_strategy"], run.context["num_replicas"]) == ("none", 1)
