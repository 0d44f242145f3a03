"""ssd_chat.engine: pure inference (no UI imports).

Public surface: :class:`Engine`, :class:`EngineConfig`, :class:`SamplingParams`,
and the event types in :mod:`ssd_chat.engine.events`.  Names load on first use, so
importing a light part of the engine (its config or events) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "DECODERS": "engine", "Engine": "engine",
    "MODES": "config", "EngineConfig": "config",
    "DeviceError": "errors", "ModelError": "errors", "ParamError": "errors", "SSDChatError": "errors",
    "TokenizerMismatchError": "errors",
    "Done": "events", "Error": "events", "Event": "events", "Notice": "events", "Round": "events", "Stats": "events",
    "Token": "events",
    "SamplingParams": "params",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
