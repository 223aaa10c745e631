"""Keras 3 on its TensorFlow backend: the traced-step taps, in-graph
counters, the optimizer and loss-scale hooks, the layer walk, device facts
and the replay of a captured step, all in TensorFlow.
"""
