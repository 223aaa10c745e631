"""Two logical CPU devices, for MirroredStrategy tests in a fresh process.

Logical devices can only be configured before TensorFlow initializes its
devices, so the scripts that need them call this right after importing
TensorFlow.
"""

import tensorflow as tf


def split_cpu_in_two() -> None:
    """Makes /cpu:0 and /cpu:1 out of the machine's CPU."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )
