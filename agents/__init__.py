"""Per-instance agents ("llumlets") and the engines they drive."""

#: Marks this top-level package as shoal's own; `shoal` checks it at start-up (frontend/packages.py).
__shoal_package__ = True
