"""Pairing only between instances that can exchange KV: same model and layout, engine and transport."""

from __future__ import annotations

import msgspec

from scheduler.policy import compatibility_key, pair_instances
from schemas.instance import InstanceJoined, KVLayout, ModelIdentity
from tests.scheduler.test_pairing_selection import CONFIG, with_freeness

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
BASE = InstanceJoined(
    instance_id="a",
    num_blocks=100,
    block_size=16,
    model=ModelIdentity(model_id="tiny"),
    kv_layout=LAYOUT,
    transport_address="tcp://10.0.0.1:5000",
    transport_kind="tcp",
    engine="torch",
)


def test_engine_and_transport_kind_are_part_of_the_key() -> None:
    same = msgspec.structs.replace(BASE, instance_id="b", transport_address="tcp://10.0.0.2:6000")
    assert compatibility_key(same) == compatibility_key(BASE)  # where it listens does not matter
    ucx = msgspec.structs.replace(BASE, transport_address="ucx://10.0.0.2:6000", transport_kind="ucx")
    vllm = msgspec.structs.replace(BASE, engine="vllm")
    assert compatibility_key(ucx) != compatibility_key(BASE)
    assert compatibility_key(vllm) != compatibility_key(BASE)
    # an agent from before transport_kind: its address's scheme says it
    old = msgspec.structs.replace(BASE, transport_kind="", transport_address="ucx://10.0.0.3:1")
    assert compatibility_key(old) == compatibility_key(ucx)


def test_an_overloaded_tcp_instance_is_not_paired_with_an_idle_ucx_one() -> None:
    tcp = compatibility_key(BASE)
    ucx = compatibility_key(
        msgspec.structs.replace(BASE, transport_address="ucx://h:1", transport_kind="ucx")
    )
    loads = [with_freeness("src", -5, group=tcp), with_freeness("ucx-idle", 90, group=ucx)]
    assert not pair_instances(loads, [], CONFIG).paired
    loads.append(with_freeness("tcp-idle", 60, group=tcp))
    assert [(p.source_id, p.destination_id) for p in pair_instances(loads, [], CONFIG).paired] == [
        ("src", "tcp-idle")
    ]
