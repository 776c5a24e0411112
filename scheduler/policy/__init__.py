"""The pure policy core: virtual usage and freeness, dispatch, migration pairing,
request selection and auto-scaling.

Everything here is synchronous and deterministic over immutable inputs: no I/O,
no clock reads (time is passed in), no imports from ``bus``, ``transport``,
``frontend``, ``agents`` or the network. The live scheduler, the agents, the
frontend's bypass mode and the simulator all call these same functions.
"""

from scheduler.policy.dispatch import (
    DispatchDecision,
    Dispatcher,
    DispatchRound,
    PendingRequest,
    dispatch_pending,
    make_dispatcher,
    order_pending,
    pending_order_key,
)
from scheduler.policy.load import (
    InstanceLoad,
    compatibility_key,
    freeness_after_admit,
    infaas_load,
    load_batch_size,
    load_freeness,
    load_scaling_freeness,
    load_virtual_usage,
)
from scheduler.policy.pairing import (
    PairDecision,
    Pairing,
    PairingPlan,
    UnpairDecision,
    UnpairReason,
    pair_instances,
)
from scheduler.policy.scaling import (
    ScaleDownDecision,
    ScaleUpDecision,
    ScalingDecision,
    ScalingState,
    average_scaling_freeness,
    decide_scaling,
)
from scheduler.policy.selection import migration_order_key, select_requests_to_migrate
from scheduler.policy.virtual_usage import (
    INFINITE_USAGE,
    RunningRequest,
    blocks_for_tokens,
    freeness,
    group_running,
    instance_freeness,
    request_virtual_usage,
    scaling_freeness,
    virtual_usage,
    virtual_usage_of_groups,
)

__all__ = [
    "INFINITE_USAGE",
    "DispatchDecision",
    "DispatchRound",
    "Dispatcher",
    "InstanceLoad",
    "PairDecision",
    "Pairing",
    "PairingPlan",
    "PendingRequest",
    "RunningRequest",
    "ScaleDownDecision",
    "ScaleUpDecision",
    "ScalingDecision",
    "ScalingState",
    "UnpairDecision",
    "UnpairReason",
    "average_scaling_freeness",
    "blocks_for_tokens",
    "compatibility_key",
    "decide_scaling",
    "dispatch_pending",
    "freeness",
    "freeness_after_admit",
    "group_running",
    "infaas_load",
    "instance_freeness",
    "load_batch_size",
    "load_freeness",
    "load_scaling_freeness",
    "load_virtual_usage",
    "make_dispatcher",
    "migration_order_key",
    "order_pending",
    "pair_instances",
    "pending_order_key",
    "request_virtual_usage",
    "scaling_freeness",
    "select_requests_to_migrate",
    "virtual_usage",
    "virtual_usage_of_groups",
]
