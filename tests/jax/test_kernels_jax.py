"""XProf windows (`profile_steps`) on JAX: a real jax.profiler trace of the
window's steps in the run directory, its Tensor Core share ("no GPU kernels"
on this CPU, never 0%), the layers of JAX op names, and the profilers
beside it (keras.callbacks.TensorBoard, a trace someone else started)."""

import argparse
import collections
import glob
import json
import os
import sys

import jax_runs
import keras
import pytest
from tensorboard.plugins import base_plugin
from xplanes import write_gpu_xspace
from xprof import profile_plugin
from xprof.convert import raw_to_tool_data

import mpprof
from mpprof.backends import xprof_kernels
from mpprof.records import reader, run_context, schema

STEPS = 8  # 64 samples, batches of 8


def window_fit(log_dir, profile_steps, callbacks=(), model=None):
    x, y = jax_runs.classes(samples=8 * STEPS)
    model = model or jax_runs.classifier("mixed_bfloat16")
    # (numerics_every=1000: the window's steps run the plain step only.)
    return jax_runs.fit(log_dir, model, x, y, callbacks=callbacks,
                        profile_steps=profile_steps, numerics_every=1000)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """One fit traced over steps 2-3, read back."""
    log_dir = tmp_path_factory.mktemp("window")
    return log_dir, window_fit(log_dir, (2, 3))


def sessions(run_dir):
    return sorted(glob.glob(os.path.join(run_dir, "plugins", "profile", "*")))


def test_the_trace_holds_the_window_steps_whole(traced):
    """jax.profiler writes plugins/profile/<session>/<host>.xplane.pb under the
    run; the window waits for the device at both ends, so the trace holds
    exactly two runs of mpprof's step, each with all its XLA ops."""
    log_dir, _ = traced
    [session] = sessions(log_dir / "train")
    paths = glob.glob(os.path.join(session, "*.xplane.pb"))
    assert len(paths) == 1
    data, _ = raw_to_tool_data.xspace_to_tool_data(paths, "trace_viewer", {})
    ops_per_run = collections.Counter(
        event["args"].get("run_id") for event in json.loads(data)["traceEvents"]
        if event.get("ph") == "X" and event.get("args", {}).get("hlo_module") == "jit_step")
    assert len(ops_per_run) == 2, ops_per_run
    assert len(set(ops_per_run.values())) == 1, ops_per_run  # both runs whole


def test_tensorboard_profile_plugin_lists_the_trace(traced):
    """XProf on a CPU trace of JAX: no kernel_stats tool (no GPU kernels),
    the trace viewer and the graph viewer are there."""
    log_dir, _ = traced
    context = base_plugin.TBContext(
        logdir=str(log_dir), flags=argparse.Namespace(master_tpu_unsecure_channel=""))
    plugin = profile_plugin.ProfilePlugin(context)
    [session] = sessions(log_dir / "train")
    runs = plugin.runs_imp()
    assert runs == [f"train/{os.path.basename(session)}"]
    tools = plugin.run_tools_imp(runs[0])
    assert {"trace_viewer@", "graph_viewer"} <= set(tools)
    assert "kernel_stats" not in tools


def dot_op_names(session) -> set[str]:
    """The op names of the dot_generals in mpprof's step, from the HLO the
    trace holds (dumped as TensorBoard's graph viewer does): the names XLA
    gives GPU kernels, which XProf's kernel_stats shows."""
    from tensorflow.compiler.xla.service import hlo_pb2

    raw_to_tool_data.xspace_to_tool_names(glob.glob(os.path.join(session, "*.xplane.pb")))
    names = set()
    for path in glob.glob(os.path.join(glob.escape(session), "jit_step(*).hlo_proto.pb")):
        proto = hlo_pb2.HloProto()
        with open(path, "rb") as f:
            proto.ParseFromString(f.read())
        names |= {instruction.metadata.op_name
                  for computation in proto.hlo_module.computations
                  for instruction in computation.instructions
                  if instruction.opcode == "dot"}
    return names


def test_layers_of_a_real_jax_traces_op_names(traced):
    log_dir, _ = traced
    [session] = sessions(log_dir / "train")
    names = dot_op_names(session)
    # Forward and backward dots of both layers: jvp(hidden), transpose(jvp(hidden)).
    assert len(names) >= 4, names
    assert all(name.startswith("jit(step)/") for name in names), names
    assert {xprof_kernels.layer_of(name) for name in names} == {"hidden", "logits"}


def test_layers_of_nested_jax_scopes(tmp_path):
    """A real trace of attention (einsum equations, vmap frames) and an LSTM
    (its cell inside a while loop): each dot's layer is a Keras layer path."""
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(50, 16)(tokens)
    x = keras.layers.MultiHeadAttention(2, 8, name="mha")(x, x)
    x = keras.layers.LSTM(16, name="lstm")(x)
    model = keras.Model(tokens, keras.layers.Dense(8, name="logits")(x))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = jax_runs.classes(samples=32)
    jax_runs.fit(tmp_path, model, (x * 50).astype("int32")[:, :8], y,
                 profile_steps=(1, 1), numerics_every=1000)
    [session] = sessions(tmp_path / "train")
    layers = {xprof_kernels.layer_of(name) for name in dot_op_names(session)}
    assert layers == {"mha", "mha/query", "mha/key", "mha/value", "mha/attention_output",
                      "lstm/lstm_cell", "logits"}


def test_a_gpu_trace_with_jax_op_names_names_their_layers(traced, tmp_path):
    """XProf's kernel_stats on a GPU plane whose kernels carry the real
    trace's op names: each missed op is listed with its layer. XProf judges
    a JAX op eligible by its primitive, the name's last part: an XLA dot
    that XLA named after a transpose it folded in
    ("transpose(jvp(logits))/transpose") is not eligible."""
    log_dir, _ = traced
    [session] = sessions(log_dir / "train")
    names = sorted(dot_op_names(session))
    durations = {name: 10 * (i + 1) for i, name in enumerate(names)}
    specs = [("sgemm_128x64_nn", name, durations[name], 1, False, True) for name in names]
    write_gpu_xspace(tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00", specs)
    share = xprof_kernels.tensor_core_share(tmp_path)
    assert share["tensor_core_share"] == 0.0
    assert share["total_gpu_kernel_us"] == sum(durations.values())
    eligible = [name for name in names if name.endswith("/dot_general")]
    assert share["eligible_not_using_us"] == sum(durations[name] for name in eligible)
    listed = {op["op_name"]: op["layer"] for op in share["top_ops"]}
    assert listed == {name: xprof_kernels.layer_of(name) for name in eligible}
    assert set(listed.values()) == {"hidden", "logits"}


def test_a_window_past_the_end_of_fit_never_opens(tmp_path):
    run = window_fit(tmp_path, (100, 200))
    entry = run.context["collectors"]["kernels"]
    assert entry["state"] == "waiting" and entry["phase"] == "waiting"
    assert entry["reason"].startswith(f"never opened: the fit ended before step 100 "
                                      f"(at step {STEPS})")
    assert schema.KERNEL_STATS not in run.records
    assert sessions(tmp_path / "train") == []


def test_a_later_fit_opens_the_window_on_its_own_steps(tmp_path):
    """The window belongs to the profiler, not one fit: a second fit that
    reaches its steps traces them (waiting on that fit's own step state)."""
    x, y = jax_runs.classes(samples=8 * STEPS)
    model = jax_runs.classifier("mixed_bfloat16")
    profiler = mpprof.MixedPrecisionProfiler(str(tmp_path), gpu_interval=None,
                                             profile_steps=(10, 11), numerics_every=1000)
    for _ in range(2):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[profiler])
    run = reader.read_run(str(tmp_path), "train")
    entry = run.context["collectors"]["kernels"]
    assert entry["phase"] == "done" and entry["reason"] == "traced steps 10-11"
    assert run.records[schema.KERNEL_STATS][-1].step == 12
    assert len(sessions(tmp_path / "train")) == 1


def profiling_tensorboard(log_dir, batches):
    """keras.callbacks.TensorBoard(profile_batch=batches) as Keras makes it
    on Python >= 3.12. Keras turns JAX profiling off below 3.12 (with a
    warning); its constructor on 3.12 calls `_init_profile_batch(batches)`
    where it calls `_init_profile_batch(0)` here, so the test does that."""
    tensorboard = keras.callbacks.TensorBoard(str(log_dir), profile_batch=batches)
    if not tensorboard._should_trace:
        tensorboard._init_profile_batch(batches)
    assert tensorboard._should_trace
    return tensorboard


def test_tensorboard_profiling_in_the_same_fit_is_reused(tmp_path):
    """One JAX profiler runs at a time: mpprof reads TensorBoard's trace."""
    tensorboard = profiling_tensorboard(tmp_path, (2, 3))
    run = window_fit(tmp_path, (1, 2), callbacks=[tensorboard])
    assert run.fit_outcome == run_context.FIT_ENDED
    entry = run.context["collectors"]["kernels"]
    assert entry["state"] == "ok" and entry["phase"] == "reusing"
    assert "TensorBoard(profile_batch" in entry["reason"]
    assert "JAX runs one profiler at a time" in entry["reason"]
    [session] = sessions(tmp_path / "train")  # TensorBoard's only: mpprof did not trace
    record = run.latest(schema.KERNEL_STATS)
    assert record["source"] == session and record["no_gpu_kernels"] is True


def test_tensorboard_as_keras_makes_it_here_leaves_the_window_alone(tmp_path):
    """Below Python 3.12 Keras' TensorBoard does not profile on JAX (it
    warns): mpprof's window traces, and Keras' callback writes no trace."""
    if sys.version_info >= (3, 12):
        tensorboard = keras.callbacks.TensorBoard(str(tmp_path / "tb"), profile_batch=(2, 3))
    else:
        with pytest.warns(UserWarning, match="requires python >= 3.12"):
            tensorboard = keras.callbacks.TensorBoard(str(tmp_path / "tb"),
                                                      profile_batch=(2, 3))
    run = window_fit(tmp_path / "run", (2, 3), callbacks=[tensorboard])
    assert run.fit_outcome == run_context.FIT_ENDED
    entry = run.context["collectors"]["kernels"]
    if tensorboard._should_trace:  # Python >= 3.12: Keras profiles, mpprof reads it
        assert entry["phase"] == "reusing" and entry["state"] == "ok"
    else:
        assert entry == {"state": "ok", "window": [2, 3], "phase": "done",
                         "reason": "traced steps 2-3", "traced_steps": [2, 3],
                         "source": sessions(tmp_path / "run" / "train")[0]}
        assert sessions(tmp_path / "tb" / "train") == []
