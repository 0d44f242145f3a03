"""Errors with a message meant for the user (the CLI prints it as one line, exit 1)."""


class SSDChatError(Exception):
    """Base class: ``str(err)`` is a complete, readable sentence."""


class ModelError(SSDChatError):
    """A model could not be found or loaded."""


class NotCachedError(ModelError):
    """A hub model is not in the local cache and cannot be downloaded now (offline, no network)."""


class TokenizerMismatchError(ModelError):
    """Target and draft do not share a vocabulary."""


class DeviceError(SSDChatError):
    """A requested device does not exist or cannot be used."""


class ParamError(SSDChatError, ValueError):
    """A generation setting is out of range."""


class SpeculatorError(SSDChatError):
    """The SSD speculator process failed (the verifier falls back)."""


class TPError(SSDChatError):
    """A tensor-parallel rank failed, died or could not start (every rank is then closed)."""
