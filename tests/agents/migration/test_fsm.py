"""The two migration state machines: each path by hand, then composed over a faulty channel."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from agents.migration.fsm import step
from agents.migration.fsm.actions import (
    Action,
    AdmitRequest,
    BlocksReceived,
    CancelCopy,
    ClaimOutcome,
    CopyBlocks,
    CopyDone,
    CopyFailed,
    FreeSourceBlocks,
    OutcomeClaimed,
    PeerFailed,
    RejectBlocks,
    ReleaseReservation,
    ReportFailed,
    ReportMigrated,
    RequestGone,
    Reserve,
    Reserved,
    ResumeOnSource,
    SendCommit,
    SendToPeer,
    Suspend,
    Suspended,
    Tick,
    WriteBlocks,
)
from agents.migration.fsm.config import MigrationConfig
from agents.migration.fsm.destination import DestinationPhase, destination_step, start_destination
from agents.migration.fsm.source import SourcePhase, SourceState, start_source
from schemas.migration import Abort, Ack, Commit, CommitAck, PreAllocate, StageDone
from schemas.reasons import MigrationAbortReason
from tests.agents.migration.world import CONFIG, World


def deliver_all(world: World) -> None:
    """A perfect channel: deliver everything in order until quiet."""
    while world.to_dst or world.to_src or world.src_pending or world.dst_pending:
        if world.to_dst:
            world.to_destination(world.to_dst.pop(0))
        elif world.to_src:
            world.to_source(world.to_src.pop(0))
        elif world.dst_pending:
            world.deliver_dst_local(0)
        else:
            world.deliver_src_local(0)


def test_a_migration_copies_in_stages_suspends_for_the_last_and_commits() -> None:
    world = World(full_blocks=20)
    world.start()
    assert world.src is not None and world.src.phase is SourcePhase.PRE_ALLOCATING
    assert world.to_dst == [PreAllocate(migration_id="m", request_id="r", source_id="a", destination_id="b",
                                        stage=0, num_blocks=20, copy_step_share=CONFIG.copy_step_share)]
    world.to_destination(world.to_dst.pop())
    assert world.dst is not None and world.dst.phase is DestinationPhase.RESERVED
    ack = world.to_src.pop()
    assert isinstance(ack, Ack) and ack.block_ids == tuple(range(20))
    world.to_source(ack)
    assert world.src.phase is SourcePhase.COPYING and world.src_pending == ["copy:0"]
    world.full_blocks = 26  # the request kept decoding during stage 0: 6 new full blocks
    world.deliver_src_local(0)
    assert [type(m).__name__ for m in world.to_dst] == ["StageDone", "PreAllocate"]
    assert world.to_dst[1].num_blocks == 6 and world.to_dst[1].stage == 1
    deliver_all(world)  # stage 1 (1 new block), then suspend, last stage, commit
    assert world.src.phase is SourcePhase.MIGRATED and world.dst.phase is DestinationPhase.COMMITTED
    assert world.dst_admitted and not world.src_owns and not world.reserved
    assert world.src.stage == 2 and world.src.last_stage  # stages 0, 1 and the last one
    assert world.src.num_copied_blocks == world.full_blocks + 1  # every block, the partial one included
    world.check_end()


def test_source_step_actions_for_the_happy_path() -> None:
    state, actions = start_source(migration_id="m", request_id="r", source_id="a", destination_id="b",
                                  num_full_blocks=10, now=0.0, config=CONFIG)
    state, actions = step(state, Ack(migration_id="m", stage=0, block_ids=tuple(range(100, 110))),
                          now=0.1, config=CONFIG)
    assert actions == (CopyBlocks(stage=0, first_block=0, end_block=10,
                                  destination_block_ids=tuple(range(100, 110))),)
    state, actions = step(state, CopyDone(stage=0, num_full_blocks=11), now=0.2, config=CONFIG)
    assert isinstance(actions[0], SendToPeer) and isinstance(actions[0].message, StageDone)
    assert actions[1:] == (Suspend(),)  # 1 new block <= last_stage_max_blocks
    state, actions = step(state, Suspended(num_blocks=12), now=0.3, config=CONFIG)
    assert actions == (SendToPeer(message=PreAllocate(migration_id="m", request_id="r", source_id="a",
                                                      destination_id="b", stage=1, num_blocks=2,
                                                      copy_step_share=CONFIG.copy_step_share)),)
    state, _ = step(state, Ack(migration_id="m", stage=1, block_ids=(7, 8)), now=0.4, config=CONFIG)
    state, actions = step(state, CopyDone(stage=1, num_full_blocks=11), now=0.5, config=CONFIG)
    assert actions[-1] == SendCommit(migration_id="m") and state.phase is SourcePhase.COMMITTING
    state, actions = step(state, CommitAck(migration_id="m", request_id="r", destination_id="b",
                                           owner_epoch=1, resumed_at=0.6), now=0.6, config=CONFIG)
    assert actions == (FreeSourceBlocks(), ReportMigrated()) and state.phase is SourcePhase.MIGRATED


def _first_stage_copied(
    config: MigrationConfig, *, full_blocks_after: int
) -> tuple[SourceState, tuple[Action, ...]]:
    """A source machine that copied a first stage of 10 blocks, the request at
    ``full_blocks_after`` full blocks when the copy ended: its state and the actions it took."""
    state, _ = start_source(migration_id="m", request_id="r", source_id="a", destination_id="b",
                            num_full_blocks=10, now=0.0, config=config)
    state, _ = step(state, Ack(migration_id="m", stage=0, block_ids=tuple(range(100, 110))),
                    now=0.1, config=config)
    return step(state, CopyDone(stage=0, num_full_blocks=full_blocks_after), now=2.0, config=config)


def test_a_paced_stage_is_caught_up_by_a_small_stage_before_the_suspend() -> None:
    # a paced stage takes ~1/share as long, so the request decodes more meanwhile: the blocks it
    # left go in one more (small, unpaced) stage, not in the last one, which runs suspended
    paced = replace(CONFIG, copy_step_share=0.1)
    state, actions = _first_stage_copied(paced, full_blocks_after=12)
    assert isinstance(actions[1], SendToPeer) and isinstance(actions[1].message, PreAllocate)
    assert actions[1].message.num_blocks == 2 and not paced.paces(2) and not state.last_stage
    state, _ = step(state, Ack(migration_id="m", stage=1, block_ids=(7, 8)), now=2.1, config=paced)
    state, actions = step(state, CopyDone(stage=1, num_full_blocks=12), now=2.2, config=paced)
    assert actions[1:] == (Suspend(),)  # the catch-up left nothing new: suspend, copy the partial block
    # unpaced, the same two blocks would have gone into the suspended last stage (as above)
    assert _first_stage_copied(CONFIG, full_blocks_after=12)[1][1:] == (Suspend(),)
    # a paced stage that left no new full block suspends at once
    assert _first_stage_copied(paced, full_blocks_after=10)[1][1:] == (Suspend(),)


def test_a_queued_request_moves_with_a_stage_of_zero_blocks_and_no_copy() -> None:
    # a request still queued on the source (no KV): hold it, reserve 0 blocks, commit
    state, actions = start_source(migration_id="m", request_id="r", source_id="a", destination_id="b",
                                  num_full_blocks=0, now=0.0, config=CONFIG)
    assert actions == (Suspend(),) and state.phase is SourcePhase.SUSPENDING
    state, actions = step(state, Suspended(num_blocks=0), now=0.1, config=CONFIG)
    assert actions == (SendToPeer(message=PreAllocate(migration_id="m", request_id="r", source_id="a",
                                                      destination_id="b", stage=0, num_blocks=0,
                                                      copy_step_share=CONFIG.copy_step_share)),)
    state, actions = step(state, Ack(migration_id="m", stage=0, block_ids=()), now=0.2, config=CONFIG)
    assert actions == (SendCommit(migration_id="m"),) and state.phase is SourcePhase.COMMITTING
    world = World(full_blocks=0, queued=True)
    world.start()
    deliver_all(world)
    assert world.src is not None and world.src.phase is SourcePhase.MIGRATED
    assert world.dst is not None and world.dst.phase is DestinationPhase.COMMITTED
    assert world.dst_admitted and not world.src_owns and world.written == [] and world.next_block == 0
    world.check_end()


def test_the_request_finishing_between_stages_aborts_and_frees_the_reservation() -> None:
    world = World(full_blocks=20)
    world.start()
    world.to_destination(world.to_dst.pop())
    world.to_source(world.to_src.pop())  # Ack: copying stage 0
    world.full_blocks = 30
    world.deliver_src_local(0)  # stage 0 done, PreAllocate(1) sent
    world.finish_request()
    assert world.src is not None and world.src.phase is SourcePhase.ABORTED
    assert isinstance(world.to_dst[-1], Abort)
    deliver_all(world)
    assert world.dst is not None and world.dst.phase is DestinationPhase.ABORTED and not world.reserved
    world.check_end()


def test_a_request_finishing_during_a_copy_aborts_when_the_copy_stops() -> None:
    world = World(full_blocks=20)
    world.start()
    world.to_destination(world.to_dst.pop())
    world.to_source(world.to_src.pop())
    world.finish_request()
    assert world.src is not None and world.src.phase is SourcePhase.COPYING  # the copy still writes
    assert not world.to_dst
    world.deliver_src_local(0)
    assert world.src.phase is SourcePhase.ABORTED and isinstance(world.to_dst[-1], Abort)
    deliver_all(world)
    world.check_end()


def test_a_destination_without_space_aborts_and_a_suspended_request_resumes() -> None:
    world = World(full_blocks=1, reserve_fails=True)  # small: straight to suspend and the last stage
    world.start()
    assert world.src_pending == ["suspend"]
    world.deliver_src_local(0)
    assert world.suspended
    deliver_all(world)
    assert world.src is not None and world.src.phase is SourcePhase.ABORTED
    assert world.src.reason is MigrationAbortReason.OUT_OF_BLOCKS  # the destination's reason, typed
    assert world.dst is not None and world.dst.reason is MigrationAbortReason.OUT_OF_BLOCKS
    assert world.src_running and not world.suspended and world.src_owns
    world.check_end()


def test_each_way_to_fail_has_its_own_reason() -> None:
    """Timeouts name their phase; peer failure, lost claims and aborts from the other side are typed."""
    reasons = MigrationAbortReason
    source, _ = start_source(migration_id="m", request_id="r", source_id="a", destination_id="b",
                             num_full_blocks=10, now=0.0, config=CONFIG)
    assert source.phase is SourcePhase.PRE_ALLOCATING
    assert step(source, Tick(), now=CONFIG.ack_timeout_s, config=CONFIG)[0].reason is reasons.ACK_TIMEOUT
    ack = Ack(migration_id="m", stage=0, block_ids=tuple(range(10)))
    copying, _ = step(source, ack, now=0.0, config=CONFIG)
    assert step(copying, Tick(), now=CONFIG.copy_timeout_s, config=CONFIG)[0].reason is reasons.COPY_TIMEOUT
    bad, actions = step(source, Ack(migration_id="m", stage=0, block_ids=(1,)), now=0.0, config=CONFIG)
    assert bad.reason is reasons.BAD_ACK and isinstance(actions[0], SendToPeer)
    assert actions[0].message == Abort(migration_id="m", reason=reasons.BAD_ACK, sender_id="a",
                                       detail="1 blocks reserved for a stage of 10")
    assert step(copying, PeerFailed(), now=0.0, config=CONFIG)[0].reason is reasons.PEER_FAILED
    # preempted under a copy, then finished, then the copy fails: the first cause is the reason
    gone = step(copying, RequestGone(reason=reasons.REQUEST_PREEMPTED), now=0.0, config=CONFIG)[0]
    gone = step(gone, RequestGone(reason=reasons.REQUEST_FINISHED), now=0.0, config=CONFIG)[0]
    failed = CopyFailed(stage=0, reason=reasons.REQUEST_FINISHED, detail="UnknownRequest")
    assert step(gone, failed, now=0.0, config=CONFIG)[0].reason is reasons.REQUEST_PREEMPTED
    failed = CopyFailed(stage=0, reason=reasons.COPY_FAILED, detail="PeerUnreachable")
    assert step(copying, failed, now=0.0, config=CONFIG)[0].reason is reasons.COPY_FAILED

    pre = PreAllocate(migration_id="m", request_id="r", source_id="a", destination_id="b", stage=0,
                      num_blocks=2)
    reserved, _ = destination_step(start_destination(pre, destination_id="b", now=0.0, config=CONFIG)[0],
                                   Reserved(stage=0, block_ids=(1, 2)), now=0.0, config=CONFIG)
    idle = CONFIG.destination_idle_timeout_s
    assert destination_step(reserved, Tick(), now=idle, config=CONFIG)[0].reason is reasons.IDLE_TIMEOUT
    assert destination_step(reserved, PeerFailed(), now=0.0, config=CONFIG)[0].reason is reasons.PEER_FAILED
    aborted, actions = destination_step(
        reserved, Abort(migration_id="m", reason=reasons.REQUEST_FINISHED), now=0.0, config=CONFIG
    )
    assert aborted.reason is reasons.REQUEST_FINISHED
    assert actions[-1] == ReportFailed(reason=reasons.REQUEST_FINISHED, detail="source aborted")
    commit = Commit(migration_id="m", request_id="r", source_id="a", destination_id="b", token_ids=(1,),
                    num_prompt_tokens=1, owner_epoch=0, suspended_at=0.0)
    claiming, _ = destination_step(reserved, commit, now=0.0, config=CONFIG)
    lost, _ = destination_step(claiming, OutcomeClaimed(committed=False), now=0.0, config=CONFIG)
    assert lost.reason is reasons.CLAIM_LOST
    unknown, actions = start_destination(commit, destination_id="b", now=0.0, config=CONFIG)
    assert unknown.reason is reasons.UNKNOWN_MIGRATION
    assert actions == (SendToPeer(message=Abort(migration_id="m", reason=reasons.UNKNOWN_MIGRATION,
                                                sender_id="b")),)


def test_ack_timeout_rolls_back_and_tells_the_destination() -> None:
    world = World()
    world.start()
    world.to_destination(world.to_dst.pop())
    world.to_src.clear()  # the Ack is lost
    world.tick(CONFIG.ack_timeout_s)
    assert world.src is not None and world.src.phase is SourcePhase.ABORTED
    assert world.src.reason is MigrationAbortReason.ACK_TIMEOUT
    deliver_all(world)
    world.check_end()


def run_until_commit_is_sent(world: World) -> None:
    """A perfect channel until the source has sent its Commit (not delivered yet)."""
    while not any(isinstance(m, Commit) for m in world.to_dst):
        if world.to_dst:
            world.to_destination(world.to_dst.pop(0))
        elif world.to_src:
            world.to_source(world.to_src.pop(0))
        elif world.dst_pending:
            world.deliver_dst_local(0)
        else:
            world.deliver_src_local(0)
    assert world.src is not None and world.src.phase is SourcePhase.COMMITTING


def test_lost_commit_ack_with_the_commit_in_the_log_frees_the_source() -> None:
    world = World(full_blocks=2)
    world.start()
    run_until_commit_is_sent(world)
    world.to_destination(world.to_dst.pop())  # the Commit arrives; the destination claims and admits
    world.deliver_dst_local(0)
    assert world.dst_admitted and world.log_outcome is True
    world.to_src.clear()  # ... but its CommitAck is lost
    world.tick(CONFIG.commit_timeout_s)
    assert world.src is not None and world.src.phase is SourcePhase.RESOLVING
    world.deliver_src_local(0)  # the log answers: committed
    assert world.src.phase is SourcePhase.MIGRATED and not world.src_owns
    world.check_end()


def test_lost_commit_with_the_abort_claimed_first_resumes_on_the_source() -> None:
    world = World(full_blocks=2)
    world.start()
    run_until_commit_is_sent(world)
    commit = world.to_dst.pop()  # delayed
    world.tick(CONFIG.commit_timeout_s)
    world.deliver_src_local(0)  # the source claimed "aborted" first and resumes
    assert world.src is not None and world.src.phase is SourcePhase.ABORTED and world.src_running
    world.to_destination(commit)  # the late Commit: the destination's claim loses
    world.deliver_dst_local(0)
    assert world.dst is not None and world.dst.phase is DestinationPhase.ABORTED and not world.dst_admitted
    deliver_all(world)
    world.check_end()


def test_peer_failure_on_either_side() -> None:
    world = World()
    world.start()
    world.to_destination(world.to_dst.pop())
    world.to_source(PeerFailed())
    assert world.src is not None and world.src.phase is SourcePhase.ABORTED
    world.to_destination(PeerFailed())
    assert world.dst is not None and world.dst.phase is DestinationPhase.ABORTED and not world.reserved
    world.check_end()


def test_destination_repeats_answers_and_refuses_late_requests() -> None:
    pre = PreAllocate(migration_id="m", request_id="r", source_id="a", destination_id="b", stage=0,
                      num_blocks=3)
    state, actions = start_destination(pre, destination_id="b", now=0.0, config=CONFIG)
    assert actions == (Reserve(stage=0, num_blocks=3),)
    state, actions = destination_step(state, Reserved(stage=0, block_ids=(4, 5, 6)), now=0.0, config=CONFIG)
    ack = Ack(migration_id="m", stage=0, block_ids=(4, 5, 6))
    assert actions == (SendToPeer(message=ack),)
    assert destination_step(state, pre, now=0.1, config=CONFIG)[1] == (SendToPeer(message=ack),)
    commit = Commit(migration_id="m", request_id="r", source_id="a", destination_id="b", token_ids=(1,),
                    num_prompt_tokens=1, owner_epoch=3, suspended_at=0.2)
    state, actions = destination_step(state, commit, now=0.3, config=CONFIG)
    assert state.phase is DestinationPhase.CLAIMING
    claimed = CommitAck(migration_id="m", request_id="r", destination_id="b", owner_epoch=4, resumed_at=0.3)
    assert actions == (ClaimOutcome(outcome=claimed),)
    state, actions = destination_step(state, OutcomeClaimed(committed=True), now=0.4, config=CONFIG)
    assert actions == (AdmitRequest(commit=commit, block_ids=(4, 5, 6)), SendToPeer(message=claimed),
                       ReportMigrated())
    assert destination_step(state, commit, now=0.5, config=CONFIG)[1] == (SendToPeer(message=claimed),)
    # an unknown migration's Commit is refused; its StageDone is not answered
    _, actions = start_destination(commit, destination_id="b", now=0.0, config=CONFIG)
    assert isinstance(actions[0], SendToPeer) and isinstance(actions[0].message, Abort)
    stage_done = StageDone(migration_id="x", stage=0, num_blocks=1, num_bytes=1, duration_s=0.0)
    assert start_destination(stage_done, destination_id="b", now=0.0, config=CONFIG)[1] == ()


def test_a_late_copy_never_lands_in_released_blocks() -> None:
    world = World(full_blocks=10)
    world.start()
    world.to_destination(world.to_dst.pop())  # reserved and acked ...
    world.to_destination(PeerFailed())  # ... then released on a false suspicion
    assert world.dst is not None and world.dst.phase is DestinationPhase.ABORTED and not world.reserved
    world.to_source(world.to_src.pop())  # the Ack still arrives: the source starts copying
    world.deliver_src_local(0)  # the data reaches the destination, which refuses it
    assert world.written == [] and world.src is not None and world.src.phase is SourcePhase.ABORTED
    assert world.src.reason is MigrationAbortReason.COPY_FAILED
    world.settle()
    world.check_end()


def test_received_blocks_go_into_the_stage_reservation() -> None:
    pre = PreAllocate(migration_id="m", request_id="r", source_id="a", destination_id="b", stage=0,
                      num_blocks=2)
    state, _ = start_destination(pre, destination_id="b", now=0.0, config=CONFIG)
    state, _ = destination_step(state, Reserved(stage=0, block_ids=(8, 9)), now=0.0, config=CONFIG)
    assert destination_step(state, BlocksReceived(stage=0), now=0.1, config=CONFIG)[1] == (
        WriteBlocks(stage=0, block_ids=(8, 9)),)
    assert isinstance(destination_step(state, BlocksReceived(stage=1), now=0.1, config=CONFIG)[1][0],
                      RejectBlocks)


def test_destination_idle_timeout_releases_the_reservation() -> None:
    pre = PreAllocate(migration_id="m", request_id="r", source_id="a", destination_id="b", stage=0,
                      num_blocks=2)
    state, _ = start_destination(pre, destination_id="b", now=0.0, config=CONFIG)
    state, _ = destination_step(state, Reserved(stage=0, block_ids=(1, 2)), now=0.0, config=CONFIG)
    assert destination_step(state, Tick(), now=CONFIG.destination_idle_timeout_s - 1, config=CONFIG)[1] == ()
    state, actions = destination_step(state, Tick(), now=CONFIG.destination_idle_timeout_s, config=CONFIG)
    assert actions[0] == ReleaseReservation(block_ids=(1, 2)) and isinstance(actions[-1], ReportFailed)
    assert state.phase is DestinationPhase.ABORTED


def test_rollback_undoes_exactly_what_is_held() -> None:
    state, _ = start_source(migration_id="m", request_id="r", source_id="a", destination_id="b",
                            num_full_blocks=10, now=0.0, config=CONFIG)
    state, _ = step(state, Ack(migration_id="m", stage=0, block_ids=tuple(range(10))), now=0.0, config=CONFIG)
    abort = Abort(migration_id="m", reason=MigrationAbortReason.DESTINATION_TERMINATING)
    _, actions = step(state, abort, now=0.1, config=CONFIG)
    assert actions == (CancelCopy(stage=0), ReportFailed(
        reason=MigrationAbortReason.DESTINATION_TERMINATING, detail="destination aborted"))
    state, _ = start_source(migration_id="m", request_id="r", source_id="a", destination_id="b",
                            num_full_blocks=1, now=0.0, config=CONFIG)
    _, actions = step(state, Tick(), now=CONFIG.suspend_timeout_s, config=CONFIG)
    assert actions == (ResumeOnSource(), ReportFailed(reason=MigrationAbortReason.SUSPEND_TIMEOUT))
    gone = RequestGone(reason=MigrationAbortReason.REQUEST_PREEMPTED)
    _, actions = step(state, gone, now=0.1, config=CONFIG)
    assert actions == (ReportFailed(reason=MigrationAbortReason.REQUEST_PREEMPTED),)  # nothing to resume


def test_messages_of_another_migration_are_ignored() -> None:
    state, _ = start_source(migration_id="m", request_id="r", source_id="a", destination_id="b",
                            num_full_blocks=10, now=0.0, config=CONFIG)
    other = Ack(migration_id="other", stage=0, block_ids=(1,))
    assert step(state, other, now=0.0, config=CONFIG) == (state, ())


# -- composed over a channel that loses, duplicates and reorders messages -----------

moves = st.lists(st.tuples(st.integers(0, 11), st.integers(0, 10_000)), max_size=120)


def apply_moves(world: World, moves: list[tuple[int, int]], finish_every: int, suspect_every: int) -> None:
    """Let the environment act: deliver, lose, duplicate, reorder, delay, and sometimes break things."""
    for kind, x in moves:
        channel = world.to_dst if x % 2 else world.to_src
        if kind in (0, 1, 2) and channel:  # deliver one message, any of them (reordering)
            message = channel.pop(x % len(channel))
            (world.to_destination if channel is world.to_dst else world.to_source)(message)
        elif kind == 3 and channel:  # lose one
            channel.pop(x % len(channel))
        elif kind == 4 and channel:  # duplicate one
            channel.append(channel[x % len(channel)])
        elif kind in (5, 6):
            world.deliver_src_local(x)
        elif kind == 7:
            world.deliver_dst_local(x)
        elif kind == 8:
            world.tick((x % 50) / 10)
        elif kind == 9:
            world.engine_step(x)
        elif kind == 10 and finish_every and x % finish_every == 0:
            world.finish_request()
        elif kind == 11 and suspect_every and x % suspect_every == 0:  # a false suspicion
            world.to_source(PeerFailed()) if x % 2 else world.to_destination(PeerFailed())
        # safety at every point: never running on both sides
        assert not (world.src_running and world.dst_admitted)


faults = st.sampled_from([(0, 0), (4, 3), (9, 7)])


@settings(max_examples=600, deadline=None)
@given(full_blocks=st.integers(1, 40), moves=moves, reserve_fails=st.booleans(), faults=faults)
def test_composed_machines_never_lose_or_duplicate_a_request(
    full_blocks: int, moves: list[tuple[int, int]], reserve_fails: bool, faults: tuple[int, int]
) -> None:
    """Loss, duplication, reordering and delays always; request endings and false failure
    suspicions often, rarely or never (``faults``: one move in n of their kind, 0 = never)."""
    world = World(full_blocks=full_blocks, reserve_fails=reserve_fails and full_blocks % 3 == 0)
    world.start()
    apply_moves(world, moves, *faults)
    world.settle()
    world.check_end()


@settings(max_examples=300, deadline=None)
@given(moves=moves, faults=faults)
def test_a_queued_move_over_a_faulty_channel_leaves_exactly_one_owner(
    moves: list[tuple[int, int]], faults: tuple[int, int]
) -> None:
    """The move of a queued request (zero blocks) under loss, duplication, reordering, delays,
    the request ending and false failure suspicions: one owner or none (it finished), nothing held."""
    world = World(full_blocks=0, queued=True)
    world.start()
    apply_moves(world, moves, *faults)
    world.settle()
    world.check_end()


@settings(max_examples=300, deadline=None)
@given(full_blocks=st.integers(1, 12), moves=moves, suspect_every=st.sampled_from([0, 3, 7]))
def test_the_commit_exchange_under_faults_leaves_exactly_one_owner(
    full_blocks: int, moves: list[tuple[int, int]], suspect_every: int
) -> None:
    """From the moment COMMIT is sent: the COMMIT or its ACK lost, late or repeated; the log decides."""
    world = World(full_blocks=full_blocks)
    world.start()
    run_until_commit_is_sent(world)
    apply_moves(world, moves, 0, suspect_every)
    world.settle()
    world.check_end()
