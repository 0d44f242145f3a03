"""Data shipped with ssd-chat (prompt sets, demo scripts, recorded sessions, trained drafts).

Installed as ``ssd_chat.assets``; read it with ``importlib.resources.files("ssd_chat.assets")``.
"""
