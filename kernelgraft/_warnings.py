"""Warnings said once per process: kernelgraft says a thing the first time it happens, whatever
the user's warning filters, and never again for the same key."""

from __future__ import annotations

import warnings

_WARNED: set = set()


def warn_once(key, message: str, stacklevel: int = 3) -> None:
    """warnings.warn(message) the first time `key` is seen in this process (whatever the filters)."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
