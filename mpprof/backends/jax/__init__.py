"""Keras 3 on JAX: the backend whose train step is a jitted, stateless
function of `(state, data)` (see `mpprof.backends.jax.backend`)."""
