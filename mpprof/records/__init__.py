"""The record format and its reading: framework-free.

`schema` names every record, tag and version; `writer` writes records as
TensorBoard event files (`tfrecord` frames them), `reader` reads a logdir
back (`event_file`, `validation`, `filesystem`), `views` and `float8` give a
run's typed views. Nothing here imports TensorFlow, Keras, JAX or torch
(an import-linter contract checks it), so a run can be read anywhere.
"""
