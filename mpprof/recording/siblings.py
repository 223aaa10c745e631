"""The other callbacks of the fit a callback runs in."""

from __future__ import annotations

import sys
from typing import Any


def sibling_callbacks(callback, callback_list_class: Any) -> list:
    """The other callbacks of the fit `callback` runs in, found on the call stack.

    A Keras callback does not know its siblings; `fit` holds them in a
    local of the model's Keras' `callback_list_class`. Returns [] when none
    is found.
    """
    frame = sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, callback_list_class) and any(
                c is callback for c in value.callbacks
            ):
                return [c for c in value.callbacks if c is not callback]
        frame = frame.f_back
    return []
