"""One-time warnings for fallbacks to the reference path."""

from __future__ import annotations

import threading
import warnings

_seen: set[str] = set()
_lock = threading.Lock()


class PkJaxFallbackWarning(UserWarning):
    """An op took its reference (XLA collective) path instead of a kernel."""


def warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    warnings.warn(message, PkJaxFallbackWarning, stacklevel=3)
