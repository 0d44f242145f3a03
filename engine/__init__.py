"""ssd_chat.engine: pure inference (no UI imports).

Public surface: :class:`Engine`, :class:`EngineConfig`, :class:`SamplingParams`,
and the event types in :mod:`ssd_chat.engine.events`.
"""

from .engine import DECODERS, MODES, Engine, EngineConfig
from .errors import DeviceError, ModelError, ParamError, SSDChatError, TokenizerMismatchError
from .events import Done, Error, Event, Notice, Round, Stats, Token
from .params import SamplingParams

__all__ = [
    "DECODERS", "MODES", "Engine", "EngineConfig", "SamplingParams",
    "Done", "Error", "Event", "Notice", "Round", "Stats", "Token",
    "DeviceError", "ModelError", "ParamError", "SSDChatError", "TokenizerMismatchError",
]
