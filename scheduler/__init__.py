"""The global scheduler: pure policies, the cluster-state fold, migration state
machines, the service loop, and the discrete-event simulator."""
