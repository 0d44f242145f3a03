"""Loading models: the catalog, chat templates, placement, preflight, precision and GGUF/conversion."""
