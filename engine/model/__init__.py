"""Running a model: the compact core, its compile and cache, attention, runners and the forward registry."""
