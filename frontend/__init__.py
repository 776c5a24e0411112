"""The front door: the ``shoal`` command line and the OpenAI-compatible HTTP API."""
