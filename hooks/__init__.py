"""rankwatch's in-process hook: heartbeats and per-phase timings into shared memory.

``python -m rankwatch.hooks train.py`` (or under torchrun) instruments an unmodified script. For
custom loops: ``init()``, ``with phase("checkpoint", budget_s=900): ...``, ``step()``.
Importing this package does not import torch.
"""

from .api import init, phase, step

__all__ = ["init", "instrument", "phase", "step"]


def instrument() -> bool:
    """init() plus the automatic phase points (DataLoader, forward, backward, optimizer, collectives)."""
    from . import api

    if not init():
        return False
    tracker = api.current()
    if tracker is None:
        return False
    try:
        from .instrument import install

        install(tracker)
    except Exception as exc:  # never break the script over instrumentation
        import warnings

        warnings.warn(f"rankwatch: automatic instrumentation failed: {exc!r}", RuntimeWarning, stacklevel=2)
    return True
