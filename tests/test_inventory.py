"""The precision inventory on real models trained on CPU."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mnist_like, seed_model

import mpprof
from mpprof import diagnosis, report
from mpprof.records import reader
from tensorboard_plugin_mpprof import payloads


def _fit(model, x, y, logdir, **fit_kwargs):
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(logdir))], **fit_kwargs)
    return reader.read_run(logdir, "train")


def _by_name(inventory):
    return {layer["name"]: layer for layer in inventory["layers"]}


def test_seed_model_with_float32_logits(seed_logdir):
    inventory = reader.read_run(seed_logdir, "train").inventory
    layers = _by_name(inventory)
    assert [layer["name"] for layer in inventory["layers"]] == ["dense", "dense_1"]
    hidden, logits = layers["dense"], layers["dense_1"]
    assert (hidden["compute_dtype"], hidden["variable_dtype"]) == ("float16", "float32")
    assert hidden["output_dtypes"] == ["float16"]
    assert hidden["gemm_dims"] == [784, 256] and hidden["tensor_core_friendly"] is True
    assert logits["policy"] == "float32" and logits["output_dtypes"] == ["float32"]
    assert logits["float32_island"] is True and hidden["float32_island"] is False
    assert hidden["params"] == 784 * 256 + 256 and logits["params"] == 256 * 10 + 10
    assert inventory["model"]["output_dtypes"] == ["float32"]
    casts = {(c["from_layer"], c["layer"], c["from_dtype"], c["to_dtype"])
             for c in inventory["casts"]}
    assert casts == {(None, "dense", "float32", "float16"),
                     ("dense", "dense_1", "float16", "float32")}


def test_float16_softmax_and_misaligned_units(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu", name="hidden"),
        keras.layers.Dense(10, name="logits"),
        keras.layers.Softmax(name="softmax"),
    ])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x, y = mnist_like(64)
    inventory = _fit(model, x, y, tmp_path).inventory
    layers = _by_name(inventory)
    assert layers["softmax"]["output_dtypes"] == ["float16"]
    assert inventory["model"]["output_dtypes"] == ["float16"]
    assert layers["logits"]["misaligned_dims"] == [10]
    assert layers["logits"]["tensor_core_friendly"] is False
    assert not any(layer["float32_island"] for layer in inventory["layers"])


def test_functional_branches_in_call_order(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    inputs = keras.Input((16,))
    left = keras.layers.Dense(8, name="left")(inputs)
    right = keras.layers.Dense(8, name="right", dtype="float32")(inputs)
    merged = keras.layers.Add(name="merge")([left, right])
    outputs = keras.layers.Dense(1, name="head", dtype="float32")(merged)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    inventory = _fit(model, np.ones((32, 16), "float32"), np.ones((32, 1), "float32"),
                     tmp_path).inventory
    order = [layer["name"] for layer in inventory["layers"]]
    assert order.index("merge") > max(order.index("left"), order.index("right"))
    assert order.index("head") == len(order) - 1
    layers = _by_name(inventory)
    assert layers["merge"]["compute_dtype"] == "float16"
    assert layers["right"]["float32_island"] and not layers["left"]["float32_island"]
    casts = {(c["from_layer"], c["layer"], c["from_dtype"], c["to_dtype"])
             for c in inventory["casts"]}
    assert ("right", "merge", "float32", "float16") in casts
    assert ("merge", "head", "float16", "float32") in casts


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.Sequential([keras.layers.Dense(12, activation="relu")], name="inner")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(self.inner(x))


class SubclassedNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Dense(16, name="embed")
        self.block = Block(name="block")
        self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha")
        self.head = keras.layers.Dense(1, dtype="float32", name="head")

    def call(self, x):
        h = self.embed(x)
        h = self.attention(h, h)
        return self.head(self.block(h))


@pytest.fixture(scope="module")
def subclassed_inventory(tmp_path_factory):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = SubclassedNet()
    model.compile(optimizer="adam", loss="mse")
    logdir = tmp_path_factory.mktemp("subclassed")
    x, y = np.random.rand(32, 6, 8).astype("float32"), np.random.rand(32, 6, 1).astype("float32")
    return _fit(model, x, y, logdir).inventory


def test_subclassed_nested_model_layers(subclassed_inventory):
    layers = _by_name(subclassed_inventory)
    assert layers["block"]["is_leaf"] is False
    assert layers["block/inner"]["parent"] == "block"
    nested_dense = [n for n in layers if n.startswith("block/inner/")]
    assert len(nested_dense) == 1 and layers[nested_dense[0]]["output_dtypes"] == ["float16"]
    assert layers["block/norm"]["compute_dtype"] == "float16"
    called = [layer for layer in subclassed_inventory["layers"] if layer["call_index"] is not None]
    indexes = [layer["call_index"] for layer in called]
    assert indexes == sorted(indexes) and len(set(indexes)) == len(indexes)
    names = [layer["name"] for layer in called]
    assert names.index("embed") < names.index("mha") < names.index(nested_dense[0])
    assert names.index("block/norm") < names.index("head")


def test_multi_head_attention_internals(subclassed_inventory):
    layers = _by_name(subclassed_inventory)
    internals = {n.split("/", 1)[1]: layer for n, layer in layers.items() if n.startswith("mha/")}
    assert {"query", "key", "value", "attention_output"} <= set(internals)
    # query: (d_model=16) -> heads * key_dim = 8; output: 8 -> 16.
    assert internals["query"]["gemm_dims"] == [16, 8]
    assert internals["attention_output"]["gemm_dims"] == [8, 16]
    assert all(internals[n]["call_index"] is not None for n in ("query", "key", "value"))
    assert internals["query"]["output_dtypes"] == ["float16"]


def test_mixed_bfloat16_actual_dtypes(tmp_path):
    model = seed_model("mixed_bfloat16")
    x, y = mnist_like(64)
    run = _fit(model, x, y, tmp_path)
    layers = _by_name(run.inventory)
    assert layers["dense"]["output_dtypes"] == ["bfloat16"]
    assert layers["dense"]["variable_dtype"] == "float32"
    assert run.context["model_policy"] == "mixed_bfloat16"


@pytest.fixture(scope="module")
def conv_zoo_run(tmp_path_factory):
    """One mixed_float16 model with every GEMM-bearing layer class, each with
    distinct (mostly misaligned) channel counts, trained for 2 steps."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 4))
    h = keras.layers.Conv2D(12, 3, padding="same", name="conv2d")(inputs)
    h = keras.layers.Conv2DTranspose(20, 3, padding="same", name="transpose")(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same", name="depthwise")(h)
    h = keras.layers.SeparableConv2D(10, 3, padding="same", depth_multiplier=2,
                                     name="separable")(h)
    sequence = keras.layers.Reshape((64, 10))(h)
    h = keras.layers.Conv1D(6, 3, padding="same", name="conv1d")(sequence)
    h = keras.layers.Reshape((4, 4, 4, 6))(h)
    h = keras.layers.Conv3D(5, 2, padding="same", name="conv3d")(h)
    h = keras.layers.GlobalAveragePooling3D()(h)
    h = keras.layers.EinsumDense("ab,bc->ac", output_shape=9, name="einsum")(h)
    attended = keras.layers.MultiHeadAttention(2, key_dim=6, name="mha")(sequence, sequence)
    pooled = keras.layers.GlobalAveragePooling1D()(attended)
    h = keras.layers.Concatenate()([h, pooled])
    h = keras.layers.Dense(3, name="dense")(h)
    outputs = keras.layers.Dense(1, dtype="float32", name="head")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 8, 8, 4), dtype=np.float32), rng.random((32, 1), dtype=np.float32)
    logdir = tmp_path_factory.mktemp("conv_zoo")
    return _fit(model, x, y, logdir)


def test_gemm_dims_follow_each_layer_class_kernel_layout(conv_zoo_run):
    layers = _by_name(conv_zoo_run.inventory)

    def gemm(name):
        return layers[name]["gemm_dims"], layers[name]["gemm_arguments"]

    # (input channels, filters) for convolutions of every rank.
    assert gemm("conv2d") == ([4, 12], [None, "filters"])
    assert gemm("conv1d") == ([10, 6], [None, "filters"])
    assert gemm("conv3d") == ([6, 5], [None, "filters"])
    # A transposed conv's kernel is (..., filters, input channels).
    assert gemm("transpose") == ([12, 20], [None, "filters"])
    # A depthwise conv runs no GEMM.
    assert layers["depthwise"]["gemm_dims"] is None
    # A separable conv's GEMM is its pointwise part: 20 channels x 2 -> 10.
    assert gemm("separable") == ([40, 10], [None, "filters"])
    assert gemm("einsum") == ([5, 9], [None, "output_shape"])
    assert gemm("dense") == ([9 + 10, 3], [None, "units"])  # einsum 9 + attention 10
    assert gemm("mha") == ([6, 6], ["key_dim", "value_dim"])


def test_tensor_core_lint_per_layer_class(conv_zoo_run):
    from mpprof import diagnosis

    # A CPU run: Tensor Core shapes do not apply, except as a stated projection.
    assert not [f for f in diagnosis.diagnose(conv_zoo_run) if f.code == "MP007"]
    (found,) = [f for f in diagnosis.diagnose(conv_zoo_run, assume_gpu=True)
                if f.code == "MP007"]
    layers = found.evidence["layers"]
    # The layers whose GEMMs are at least 5% of the model's GEMM work (from the
    # traced output shapes): attention over 64 positions and the convolutions
    # at 8x8; conv1d, conv3d (3-4%), einsum and dense are below it.
    assert set(layers) == {"conv2d", "transpose", "separable", "mha"}
    assert {"conv1d", "conv3d", "einsum", "dense"} <= set(found.evidence["not_judged"])
    assert "depthwise" not in found.fix and "head" not in layers  # no GEMM; float32
    shares = [entry["gemm_flops_share"] for entry in layers.values()]
    assert all(share >= diagnosis.MIN_GEMM_FLOPS_SHARE for share in shares)
    # conv2d's 4 input channels are the data's: only its 12 filters are judged.
    assert layers["conv2d"]["misaligned_dims"] == [12]
    assert layers["transpose"]["misaligned_dims"] == [12, 20]
    assert "input channels 12 -> 16" in found.fix and "filters 20 -> 24" in found.fix
    assert "keras.layers.Conv2DTranspose(filters=24, ...)" in found.fix
    assert "keras.layers.MultiHeadAttention(key_dim=8, ...)" in found.fix


def test_dtype_policy_map_records_what_each_layer_computes_in(tmp_path):
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="mixed_float16")
    policy_map["head"] = "float32"
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, name="hidden", dtype=policy_map)(inputs)
    outputs = keras.layers.Dense(4, name="head", dtype=policy_map)(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    x, y = np.ones((32, 8), np.float32), np.zeros((32, 4), np.float32)
    layers = _by_name(_fit(model, x, y, tmp_path).inventory)
    assert layers["head"]["compute_dtype"] == "float32"
    assert layers["head"]["output_dtypes"] == ["float32"]
    assert layers["head"]["float32_island"] is True
    assert layers["hidden"]["compute_dtype"] == "float16"


def test_a_container_has_no_gemm_of_its_own(subclassed_inventory):
    layers = _by_name(subclassed_inventory)
    # "block" holds a Dense: its weights are the Dense's, not a GEMM of its own.
    assert layers["block"]["is_leaf"] is False and layers["block"]["gemm_dims"] is None
    assert layers["block"]["misaligned_dims"] == []


def _inventory_note(run) -> str:
    notes = {note.code: note for note in diagnosis.evaluate(run).notes}
    return notes["MP006"].reason


def test_a_step_that_calls_no_layer_says_so_not_that_it_never_traced(tmp_path):
    class NoLayerCalled(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, inputs):
            return self.dense(inputs)

        def train_step(self, data):
            return {"loss": tf.constant(0.0)}

    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = NoLayerCalled()
    x = np.ones((16, 4), np.float32)
    model(x)
    keras.mixed_precision.set_dtype_policy("float32")
    model.compile(optimizer="sgd", loss="mse")
    run = _fit(model, x, np.ones((16, 2), np.float32), tmp_path)
    assert run.inventory is None
    state = run.context["collectors"]["precision"]
    assert state["state"] == "ok" and state["traced"] is False
    assert "ran but called no layer" in state["reason"]
    assert "never traced" not in _inventory_note(run)
    assert "ran but called no layer" in _inventory_note(run)
    # The dashboard and the HTML report give the same reason.
    assert "ran but called no layer" in payloads.inventory_payload(run)["reason"]
    html = report.build_report(str(tmp_path))
    assert "ran but called no layer" in html and "never traced" not in html


def test_a_fit_stopped_before_its_first_step_says_the_step_never_traced(tmp_path):
    class StopAtFirstBatch(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            raise RuntimeError("stopped before the first step")

    model = seed_model("mixed_float16")
    keras.mixed_precision.set_dtype_policy("float32")
    x, y = mnist_like(32)
    with pytest.raises(RuntimeError, match="stopped before the first step"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[
            mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path)), StopAtFirstBatch()])
    run = reader.read_run(tmp_path, "train")
    assert run.inventory is None
    assert run.context["collectors"]["precision"]["traced"] is False
    assert "never traced" in _inventory_note(run)
