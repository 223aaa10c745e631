"""What the front ends (CLI, HTML report, TensorBoard tab) show alike.

Escaping for the terminal, the headroom measure, the float8 view, series
shrunk to a screen. Framework-free, like everything after the records.
"""
