"""The front door: the ``shoal`` command line and the OpenAI-compatible HTTP API."""

#: Marks this top-level package as shoal's own; `shoal` checks it at start-up (frontend/packages.py).
__shoal_package__ = True
