"""The prefix index: per-instance overlap of a request's chain, batch checks, drops, snapshots."""

from __future__ import annotations

import pytest

from scheduler.prefix_index import (
    ApplyOutcome,
    PrefixIndex,
    ResyncTracker,
    decode_index,
    encode_index,
    replay_index,
)
from schemas.block_hash import block_hashes
from schemas.kv_events import KVCacheEvents

BLOCK = 16


def batch(
    instance: str,
    seq: int,
    stored: tuple[int, ...] = (),
    removed: tuple[int, ...] = (),
    *,
    full: bool = False,
    incarnation: str = "a",
    block_size: int = BLOCK,
) -> KVCacheEvents:
    return KVCacheEvents(
        instance_id=instance,
        incarnation=incarnation,
        seq=seq,
        block_size=block_size,
        stored=stored,
        removed=removed,
        full=full,
    )


def chain(num_blocks: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(block_hashes([seed * 1000 + i for i in range(num_blocks * BLOCK)], BLOCK))


def test_overlap_counts_leading_blocks_per_instance() -> None:
    prompt = chain(6)
    index = PrefixIndex()
    assert index.apply(batch("i1", 1, prompt[:4], full=True)) is ApplyOutcome.REPLACED
    assert index.apply(batch("i2", 1, prompt, full=True)) is ApplyOutcome.REPLACED
    # i3 holds blocks 0, 1 and 3: only the leading two count (the chain breaks at block 2)
    index.apply(batch("i3", 1, (prompt[0], prompt[1], prompt[3]), full=True))
    index.apply(batch("i4", 1, chain(3, seed=7), full=True))  # another prompt only
    assert index.overlap(prompt, block_size=BLOCK) == {"i1": 4, "i2": 6, "i3": 2}
    assert index.overlap(prompt[:3], block_size=BLOCK) == {"i1": 3, "i2": 3, "i3": 2}
    assert index.overlap(chain(4, seed=9), block_size=BLOCK) == {}
    assert index.overlap((), block_size=BLOCK) == {}
    # another block size: the same hashes say nothing there
    assert index.overlap(prompt, block_size=32) == {}


def test_deltas_store_and_remove() -> None:
    prompt = chain(4)
    index = PrefixIndex()
    index.apply(batch("i1", 1, full=True))
    assert index.apply(batch("i1", 2, prompt[:2])) is ApplyOutcome.APPLIED
    assert index.apply(batch("i1", 3, prompt[2:], removed=(prompt[1],))) is ApplyOutcome.APPLIED
    assert index.overlap(prompt, block_size=BLOCK) == {"i1": 1}
    assert index.hashes_of("i1") == {prompt[0], prompt[2], prompt[3]}
    assert index.apply(batch("i1", 3, prompt)) is ApplyOutcome.REPEAT
    assert index.hashes_of("i1") == {prompt[0], prompt[2], prompt[3]}


def test_a_gap_marks_stale_until_a_full_batch() -> None:
    prompt = chain(4)
    index = PrefixIndex()
    index.apply(batch("i1", 1, prompt[:1], full=True))
    assert index.apply(batch("i1", 3, prompt[1:2])) is ApplyOutcome.GAP
    assert index.stale_instances() == ["i1"]
    assert index.overlap(prompt, block_size=BLOCK) == {"i1": 2}  # what it has still answers
    assert index.apply(batch("i1", 4, prompt[2:3])) is ApplyOutcome.APPLIED
    assert index.is_stale("i1")
    assert index.apply(batch("i1", 5, prompt, full=True)) is ApplyOutcome.REPLACED
    assert index.stale_instances() == []
    assert index.overlap(prompt, block_size=BLOCK) == {"i1": 4}
    assert index.num_gaps == 1


def test_an_unknown_incarnation_starts_empty_and_stale() -> None:
    prompt = chain(4)
    index = PrefixIndex()
    index.apply(batch("i1", 7, prompt, full=True, incarnation="old"))
    # the agent restarted and its first (full) batch was lost: the old cache is gone
    assert index.apply(batch("i1", 2, prompt[:1], incarnation="new")) is ApplyOutcome.UNKNOWN_INCARNATION
    assert index.overlap(prompt, block_size=BLOCK) == {"i1": 1}
    assert index.stale_instances() == ["i1"]


def test_a_dropped_instance_is_forgotten_and_its_late_batches_ignored() -> None:
    prompt = chain(3)
    index = PrefixIndex()
    index.apply(batch("i1", 1, prompt, full=True))
    index.apply(batch("i2", 1, prompt, full=True))
    assert index.drop("i1")
    assert index.overlap(prompt, block_size=BLOCK) == {"i2": 3}
    assert index.apply(batch("i1", 2, prompt)) is ApplyOutcome.DEPARTED
    assert index.instance_ids() == ["i2"]
    # a new process under the same id starts with its full batch
    assert index.apply(batch("i1", 1, prompt[:1], full=True, incarnation="b")) is ApplyOutcome.REPLACED
    assert index.overlap(prompt, block_size=BLOCK) == {"i1": 1, "i2": 3}
    index.drop("i2")
    index.drop("i1")
    assert index.num_hashes == 0 and index.num_entries == 0


@pytest.mark.parametrize(
    "bad",
    [
        batch("i1", 0, full=True),
        batch("i1", 1, full=True, block_size=0),
        batch("", 1, full=True),
        batch("i1", 1, (1 << 64,), full=True),
        batch("i1", 1, (-1,), full=True),
    ],
)
def test_malformed_batches_are_rejected_and_counted(bad: KVCacheEvents) -> None:
    index = PrefixIndex()
    assert index.apply(bad) is ApplyOutcome.MALFORMED
    assert index.num_malformed == 1 and len(index) == 0


def test_stream_positions_repeat_is_a_no_op() -> None:
    prompt = chain(2)
    index = PrefixIndex()
    index.apply(batch("i1", 1, prompt[:1], full=True), kv_seq=5)
    assert index.apply(batch("i1", 2, prompt[1:]), kv_seq=5) is ApplyOutcome.REPEAT
    assert index.kv_seq == 5 and index.hashes_of("i1") == {prompt[0]}


def test_slots_are_reused_and_many_instances_resolve() -> None:
    prompt = chain(5)
    index = PrefixIndex()
    for n in range(200):
        index.apply(batch(f"i{n:03d}", 1, prompt[: n % 6], full=True))
    for n in range(0, 200, 2):
        index.drop(f"i{n:03d}")
    for n in range(300, 350):
        index.apply(batch(f"i{n:03d}", 1, prompt, full=True))
    expected = {f"i{n:03d}": n % 6 for n in range(1, 200, 2) if n % 6} | {
        f"i{n:03d}": 5 for n in range(300, 350)
    }
    assert index.overlap(prompt, block_size=BLOCK) == expected


def test_snapshot_round_trip_and_replay_agree() -> None:
    prompt, other = chain(4), chain(4, seed=3)
    batches = [
        (1, batch("i1", 1, prompt[:2], full=True)),
        (2, batch("i2", 1, other, full=True, incarnation="x")),
        (3, batch("i1", 2, prompt[2:])),
        (4, batch("i1", 4, (), (prompt[3],))),  # a gap: stale
        (5, batch("i3", 1, prompt, full=True)),
    ]
    index = replay_index(batches[:3])
    restored = decode_index(encode_index(index))
    replay_index(batches[3:], restored)
    whole = replay_index(batches)
    assert encode_index(restored) == encode_index(whole)
    assert restored.overlap(prompt, block_size=BLOCK) == {"i1": 3, "i3": 4}
    assert restored.stale_instances() == ["i1"]
    assert decode_index(b"").num_entries == 0
    with pytest.raises(ValueError, match="does not decode"):
        decode_index(b"\xc1")


def test_resync_asks_once_then_again_after_the_timeout() -> None:
    tracker = ResyncTracker(retry_s=5.0)
    assert tracker.due(["i1", "i2"], now=100.0) == ["i1", "i2"]
    assert tracker.due(["i1", "i2"], now=102.0) == []
    assert tracker.due(["i1"], now=106.0) == ["i1"]  # i2 is in sync again: forgotten
    assert tracker.due(["i2"], now=106.5) == ["i2"]
    assert tracker.num_asked == 4


def test_a_limit_keeps_the_instances_holding_most_ties_to_the_first_seen() -> None:
    prompt = chain(4)
    index = PrefixIndex()
    for n, held in enumerate([1, 4, 2, 4, 2, 2]):
        index.apply(batch(f"i{5 - n}", 1, prompt[:held], full=True))  # seen in the order i5, i4, ...
    assert index.overlap(prompt, block_size=BLOCK, limit=3) == {"i4": 4, "i2": 4, "i3": 2}
    assert index.overlap(prompt, block_size=BLOCK, limit=0) == {}
    assert len(index.overlap(prompt, block_size=BLOCK)) == 6
    index.drop("i4")  # its slot is the lowest free one: the next instance seen takes it
    index.apply(batch("i9", 1, prompt, full=True))
    assert index.overlap(prompt, block_size=BLOCK, limit=2) == {"i9": 4, "i2": 4}
    restored = decode_index(encode_index(index))  # slots survive a snapshot, and with them the ties
    assert restored.overlap(prompt, block_size=BLOCK, limit=4) == index.overlap(
        prompt, block_size=BLOCK, limit=4
    )


def test_a_late_batch_of_a_replaced_incarnation_is_ignored() -> None:
    prompt = chain(3)
    index = PrefixIndex()
    index.apply(batch("i1", 4, prompt, full=True, incarnation="old"))
    index.apply(batch("i1", 1, prompt[:1], full=True, incarnation="new"))  # the agent restarted
    assert index.apply(batch("i1", 5, prompt[1:], incarnation="old")) is ApplyOutcome.DEPARTED
    assert index.hashes_of("i1") == {prompt[0]} and not index.is_stale("i1")
