"""Built-in features, written as plugins on the public hooks (see ``DEFAULT_PLUGINS``)."""
