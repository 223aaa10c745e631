"""Models from keras-io, as published, shrunk: code nobody here wrote.

Each builder copies the model code of a keras-io example or guide (the
repository keras-team/keras-io; the file is named in its docstring) with its
sizes made small and its data random, so that mpprof is tried on models as
users write them. Where a test breaks a model the way users break it (raw
16-bit inputs, a float16 head, a forgotten `scale_loss`, a metric with no
float16 kernel), the change is one argument, named in the builder.

Backend-neutral (Keras 3 ops) except the TensorFlow-only code that the
examples publish for TensorFlow (the VAE's `train_step` and sampling).
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops

# ---------------------------------------------------------------------------
# examples/vision/mnist_convnet.py (fchollet): input_shape and num_classes as
# published; the data is random.


def mnist_convnet(head_dtype=None, first_conv_dtype=None) -> keras.Model:
    """The published convnet; `head_dtype="float32"` is the healthy mixed
    precision version (the published head outputs float16 under
    mixed_float16: MP006); `first_conv_dtype` applies a replay's map."""
    num_classes = 10
    input_shape = (28, 28, 1)
    model = keras.Sequential(
        [
            keras.Input(shape=input_shape),
            layers.Conv2D(32, kernel_size=(3, 3), activation="relu", dtype=first_conv_dtype),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            layers.Dropout(0.5),
            layers.Dense(num_classes, activation="softmax", dtype=head_dtype),
        ]
    )
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def mnist_data(samples: int, raw_units: bool = False, seed: int = 0):
    """Random 28x28 grayscale 16-bit images and one-hot labels the model can
    learn in a few steps (the label is the one quadrant left bright, the
    others dimmed to 50-80%), so that a retrained fix is compared with
    float32 on learning, not on noise. As published the pixels are scaled
    to [0, 1]; `raw_units` feeds them unscaled (0..65535: the `/ 65535`
    forgotten), past float16's 65504."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 65536, size=(samples, 2, 14, 2, 14)).astype("float32")
    labels = rng.integers(0, 4, size=samples)
    dim = 0.5 + 0.3 * rng.random((samples, 2, 1, 2, 1))
    keep = np.zeros((samples, 2, 1, 2, 1), dtype=bool)
    keep[np.arange(samples), labels // 2, 0, labels % 2, 0] = True
    pixels = np.floor(np.where(keep, pixels, pixels * dim)).astype("float32")
    pixels = pixels.reshape(samples, 28, 28, 1)
    y = keras.utils.to_categorical(labels, 10)
    x = pixels if raw_units else pixels / 65535
    return x, y


def mnist_retrained_losses(policy: str, scale: float, x, y, batch_size: int, steps: int = 30,
                           first_conv_dtype=None) -> list[float]:
    """How both suites retrain a replay's fix: the loss of each step of the
    published convnet (float32 head) under `policy`, trained `steps` steps
    on the batches of (x * scale, y), cycled, from the seeded initial
    weights (as verification's trial trains); `first_conv_dtype` applies a
    float32 map."""
    keras.backend.clear_session()  # layer names from 1 again: conv2d, dense...
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy(policy)
    model = mnist_convnet("float32", first_conv_dtype)
    batches = len(x) // batch_size
    losses = [float(model.train_on_batch(x[i * batch_size:(i + 1) * batch_size] * scale,
                                         y[i * batch_size:(i + 1) * batch_size],
                                         return_dict=True)["loss"])
              for i in (step % batches for step in range(steps))]
    keras.mixed_precision.set_dtype_policy("float32")
    return losses


# ---------------------------------------------------------------------------
# examples/nlp/text_classification_with_transformer.py (Apoorv Nandan, Keras 3
# version): the blocks as published; vocab_size and maxlen shrunk.


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [
                layers.Dense(ff_dim, activation="relu"),
                layers.Dense(embed_dim),
            ]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


TEXT_VOCAB, TEXT_MAXLEN = 200, 16  # published: 20000, 200


def text_transformer(head_dtype=None) -> keras.Model:
    """The published classifier (embed_dim 32, 2 heads, ff_dim 32); its
    2-class softmax head outputs float16 as published (`head_dtype`)."""
    vocab_size, maxlen = TEXT_VOCAB, TEXT_MAXLEN
    embed_dim = 32  # Embedding size for each token
    num_heads = 2  # Number of attention heads
    ff_dim = 32  # Hidden layer size in feed forward network inside transformer

    inputs = layers.Input(shape=(maxlen,))
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax", dtype=head_dtype)(x)

    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(
        optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    return model


def text_data(samples: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, TEXT_VOCAB, size=(samples, TEXT_MAXLEN))
    return x, rng.integers(0, 2, size=samples)


# ---------------------------------------------------------------------------
# examples/nlp/bidirectional_lstm_imdb.py (fchollet): the model as published;
# max_features, maxlen and the widths shrunk.

BILSTM_VOCAB, BILSTM_MAXLEN = 200, 16  # published: 20000, 200


def bidirectional_lstm(head_dtype=None) -> keras.Model:
    """The published two-layer bidirectional LSTM classifier (Embedding 128
    and LSTM 64 as published, here 16 and 8); its sigmoid head outputs
    float16 under mixed_float16 as published (`head_dtype`)."""
    max_features = BILSTM_VOCAB  # Only consider the top words
    # Input for variable-length sequences of integers
    inputs = keras.Input(shape=(None,), dtype="int32")
    # Embed each integer in a 16-dimensional vector
    x = layers.Embedding(max_features, 16)(inputs)
    # Add 2 bidirectional LSTMs
    x = layers.Bidirectional(layers.LSTM(8, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(8))(x)
    # Add a classifier
    outputs = layers.Dense(1, activation="sigmoid", dtype=head_dtype)(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


def imdb_data(samples: int, seed: int = 0):
    """Random token sequences; the label says whether token 0 of the
    vocabulary's first half is more frequent than of its second half."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, BILSTM_VOCAB, size=(samples, BILSTM_MAXLEN)).astype("int32")
    y = (np.mean(x < BILSTM_VOCAB // 2, axis=1) > 0.5).astype("float32")
    return x, y


# ---------------------------------------------------------------------------
# examples/vision/image_classification_with_vision_transformer.py (Khalid
# Salama): Patches, PatchEncoder, mlp and the classifier as published; the
# image 16x16, 1 transformer layer, the MLP head 64 wide, no augmentation
# layers but the Normalization the example adapts.

VIT_CLASSES, VIT_IMAGE, VIT_PATCH = 10, 16, 4
VIT_PROJECTION, VIT_HEADS = 16, 2


def mlp(x, hidden_units, dropout_rate):
    for units in hidden_units:
        x = layers.Dense(units, activation=keras.activations.gelu)(x)
        x = layers.Dropout(dropout_rate)(x)
    return x


class Patches(layers.Layer):
    def __init__(self, patch_size):
        super().__init__()
        self.patch_size = patch_size

    def call(self, images):
        input_shape = ops.shape(images)
        batch_size = input_shape[0]
        height = input_shape[1]
        width = input_shape[2]
        channels = input_shape[3]
        num_patches_h = height // self.patch_size
        num_patches_w = width // self.patch_size
        patches = keras.ops.image.extract_patches(images, size=self.patch_size)
        patches = ops.reshape(
            patches,
            (
                batch_size,
                num_patches_h * num_patches_w,
                self.patch_size * self.patch_size * channels,
            ),
        )
        return patches


class PatchEncoder(layers.Layer):
    def __init__(self, num_patches, projection_dim):
        super().__init__()
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(
            input_dim=num_patches, output_dim=projection_dim
        )

    def call(self, patch):
        positions = ops.expand_dims(
            ops.arange(start=0, stop=self.num_patches, step=1), axis=0
        )
        projected_patches = self.projection(patch)
        encoded = projected_patches + self.position_embedding(positions)
        return encoded


def vit_classifier(top5: bool = True, head_dtype=None) -> keras.Model:
    """The published ViT compiled as published (AdamW, from_logits, a top-5
    accuracy metric); its logits are float16 under mixed_float16, which
    TensorFlow's InTopKV2 (the top-5 metric) has no kernel for."""
    input_shape = (VIT_IMAGE, VIT_IMAGE, 3)
    patch_size = VIT_PATCH
    num_patches = (VIT_IMAGE // patch_size) ** 2
    projection_dim, num_heads = VIT_PROJECTION, VIT_HEADS
    hidden_dim = projection_dim * num_heads
    transformer_units = [hidden_dim * 2, hidden_dim]
    transformer_layers = 1
    mlp_head_units = [64, 32]

    inputs = keras.Input(shape=input_shape)
    augmented = layers.Normalization(mean=0.5, variance=0.08)(inputs)
    patches = Patches(patch_size)(augmented)
    encoded_patches = PatchEncoder(num_patches, hidden_dim)(patches)
    for _ in range(transformer_layers):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
        attention_output = layers.MultiHeadAttention(
            num_heads=num_heads, key_dim=projection_dim, dropout=0.1
        )(x1, x1)
        x2 = layers.Add()([attention_output, encoded_patches])
        x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
        x3 = mlp(x3, hidden_units=transformer_units, dropout_rate=0.1)
        encoded_patches = layers.Add()([x3, x2])
    representation = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
    representation = layers.Flatten()(representation)
    representation = layers.Dropout(0.5)(representation)
    features = mlp(representation, hidden_units=mlp_head_units, dropout_rate=0.5)
    logits = layers.Dense(VIT_CLASSES, dtype=head_dtype)(features)
    model = keras.Model(inputs=inputs, outputs=logits)

    metrics = [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
    if top5:
        metrics.append(keras.metrics.SparseTopKCategoricalAccuracy(5, name="top-5-accuracy"))
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=metrics,
    )
    return model


def vit_data(samples: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.random((samples, VIT_IMAGE, VIT_IMAGE, 3)).astype("float32")
    return x, rng.integers(0, VIT_CLASSES, size=(samples, 1))
