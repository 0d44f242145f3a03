"""The settings typed between replies live with the settings dialog (:mod:`.widgets.changes`); this name is kept for importers outside ``tui/``."""

from .widgets.changes import ENGINE_CHANGES, SLASH_KEYS, parse_settings  # noqa: F401
