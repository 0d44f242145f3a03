"""ssd-chat: a local LLM chat in the terminal with exact speculative speculative decoding."""

__version__ = "0.1.0"
