"""A tiny registry of monkey patches that can be installed and removed."""
import functools
from typing import Any, Callable, List, Tuple

__all__ = ["PatchSet"]


class PatchSet:
    """Replaces attributes with wrappers and restores the originals on removal.

    ``add(owner, name, make_wrapper)`` calls ``make_wrapper(original)`` and sets
    the result as ``owner.name``; ``remove()`` undoes every patch in reverse
    order. Installing twice is a no-op.
    """

    def __init__(self) -> None:
        self._saved: List[Tuple[Any, str, Any]] = []

    @property
    def installed(self) -> bool:
        return bool(self._saved)

    def add(self, owner: Any, name: str, make_wrapper: Callable[[Any], Any]) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        func = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
        wrapper = make_wrapper(func)
        if callable(func) and callable(wrapper):
            functools.update_wrapper(wrapper, func)
        if isinstance(original, staticmethod):
            wrapper = staticmethod(wrapper)
        elif isinstance(original, classmethod):
            wrapper = classmethod(wrapper)
        setattr(owner, name, wrapper)
        self._saved.append((owner, name, original))

    def is_patched(self, owner: Any, name: str) -> bool:
        return any(o is owner and n == name for o, n, _ in self._saved)

    def remove(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
