"""A tiny registry of monkey patches that can be installed and removed."""
import functools
from typing import Any, Callable, List, Tuple

__all__ = ["PatchSet"]

_INHERITED = object()  # a class's attribute that only its bases define


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
        """A class's method it inherits is wrapped on the class itself (removal
        deletes the wrapper)."""
        original = (owner.__dict__.get(name, _INHERITED) if isinstance(owner, type)
                    else getattr(owner, name))
        func = getattr(owner, name) if original is _INHERITED else original
        func = func.__func__ if isinstance(func, (staticmethod, classmethod)) else func
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
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
