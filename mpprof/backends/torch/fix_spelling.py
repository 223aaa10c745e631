"""How a fix's code is spelled on PyTorch (framework-free: the diagnosis
reads it, `mpprof.fix_syntax.FixSyntax`)."""

from __future__ import annotations

from mpprof.fix_syntax import NUMPY_SCALE_INPUTS, Spelling

# The train step is the Keras guide's "Customizing what happens in fit()" for
# PyTorch. Keras' PyTorch step (TorchTrainer.train_step) calls `scale_loss`,
# then `.backward()` on the scaled loss; LossScaleOptimizer.apply divides the
# gradients by the scale (`_common_apply` on every backend but TensorFlow).
SPELLING = Spelling(
    framework="PyTorch",
    scaled_step=("opt.scale_loss(loss).backward(); "
                 "opt.apply([v.value.grad for v in variables], variables) under "
                 "torch.no_grad() unscales them."),
    custom_step=(
        "    self.zero_grad()\n"
        "    y_pred = self(x, training=True)\n"
        "    loss = self.compute_loss(x=x, y=y, y_pred=y_pred)\n"
        "    {optimizer}.scale_loss(loss).backward()\n"
        "    trainable_weights = self.trainable_weights[:]\n"
        "    gradients = [v.value.grad for v in trainable_weights]\n"
        "    with torch.no_grad():\n"
        "        {optimizer}.apply(gradients, trainable_weights)   # unscales them"
    ),
    # `jit_compile="auto"` is eager on PyTorch (Trainer._resolve_auto_jit_compile).
    compile_step=("compile the step with torch.compile: model.compile(..., "
                  "jit_compile=True) (Keras on PyTorch runs it eagerly by default; "
                  "mpprof's per-layer numerics are off under it);"),
    input_pipeline=("if the GPU is mostly idle, the input pipeline is the bottleneck: "
                    "give fit a torch.utils.data.DataLoader(..., num_workers=4, "
                    "pin_memory=True), or a tf.data or grain pipeline with prefetch."),
    scale_inputs=NUMPY_SCALE_INPUTS,
    # Keras' float8 layers quantize and dequantize around `ops.matmul`:
    # XLA fuses that into an FP8 GEMM, PyTorch runs the compute dtype's.
    float8_gemm=("float8: cuBLASLt's FP8 GEMM needs multiples of 16 (Keras on "
                 "PyTorch runs float8 layers' GEMMs in the compute dtype)"),
    float_promotion=("PyTorch promotes + and *, but its matrix products and "
                     "convolutions (@, torch.matmul, F.linear, F.conv2d) do not; "
                     "keras.ops promote, to float32"),
)
