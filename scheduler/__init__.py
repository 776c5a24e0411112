"""The global scheduler: the pure policy core (virtual usage, freeness, dispatch,
pairing, selection, scaling, the cluster-state fold), the service loop with its
lease, snapshots and replay, and the discrete-event simulator."""

#: Marks this top-level package as shoal's own; `shoal` checks it at start-up (frontend/packages.py).
__shoal_package__ = True
