"""Keras 3 on PyTorch: the backend whose train step runs eagerly, one Python
call per step (see `mpprof.backends.torch.backend`)."""
