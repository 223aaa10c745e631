"""tf-keras (Keras 2) models: what differs from Keras 3 on TensorFlow.

Built on the TensorFlow backend (`mpprof.backends.tensorflow`); its modules
carry the same names where they replace one of that backend's.
"""
