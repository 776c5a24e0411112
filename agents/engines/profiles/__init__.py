"""Built-in engine profiles (JSON data files; see :mod:`agents.engines.profile` for the format)."""

__all__: list[str] = []
