"""The live-migration protocol as two pure state machines (source and destination).

See :mod:`scheduler.migration_fsm` for the public surface; this package holds
the parts: shared inputs and actions (``common``), the source side
(``source``) and the destination side (``destination``).
"""
