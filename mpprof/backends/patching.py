"""Every patch mpprof makes to a Keras or TensorFlow object, and its undoing.

mpprof observes a training run by replacing attributes of the user's own
objects for the length of a fit: an optimizer's `apply` or `scale_loss`, the
loss-scale branches of a LossScaleOptimizer, the model's `train_step` and
`train_function`. Each replacement is an instance attribute, so it shadows the
class's method for that object alone. `Patches` records what each attribute
was before (an instance value, or nothing) and puts it back, in reverse
order, so "leave the model as found" holds however the patches were stacked.

Example:

```python
patches = Patches()
patches.set(optimizer, "scale_loss", watched_scale_loss)
...
patches.restore()  # optimizer.scale_loss is the class's method again
```
"""

from __future__ import annotations

from typing import Any

_ABSENT = object()


class Patches:
    """A stack of attribute replacements that can all be undone."""

    def __init__(self):
        self._stack: list[tuple[Any, str, Any]] = []

    def set(self, target: Any, name: str, value: Any) -> None:
        """Sets `target.name = value`, remembering the instance's own value."""
        previous = vars(target).get(name, _ABSENT) if hasattr(target, "__dict__") else _ABSENT
        setattr(target, name, value)
        self._stack.append((target, name, previous))

    def restore(self) -> list[str]:
        """Undoes every patch, newest first.

        Returns one line per patch that could not be undone (the others are
        undone all the same).
        """
        failures = []
        while self._stack:
            target, name, previous = self._stack.pop()
            try:
                if previous is _ABSENT:
                    if name in vars(target):
                        delattr(target, name)
                else:
                    setattr(target, name, previous)
            except Exception as e:  # noqa: BLE001 - undo the rest regardless
                failures.append(f"{type(target).__name__}.{name}: {e}")
        return failures

    def __len__(self) -> int:
        return len(self._stack)
