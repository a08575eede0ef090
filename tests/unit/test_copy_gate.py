"""The copy gate: windowed device-to-host feeders pause while the trainer holds it, within a limit."""

from __future__ import annotations

import threading
import time

from cpuckpt.transfer import staging
from cpuckpt.transfer.copy_gate import GATE, CopyGate


def _in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    return t, out


def _paused(wait) -> threading.Thread:
    """A feeder thread running ``wait``, checked to still wait 0.2 s later (join it after the hold)."""
    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)
    assert t.is_alive(), "the feeder went on while the trainer held the gate"
    return t


def test_a_feeder_waits_while_another_thread_holds_the_gate():
    gate = CopyGate(hold_limit_s=30.0)
    released = []
    with gate.held():
        t, out = _in_thread(lambda: (gate.wait_open(), time.monotonic()))
        time.sleep(0.3)
        assert t.is_alive(), "the feeder enqueued while the trainer held the gate"
        released.append(time.monotonic())
    t.join(5)
    _, resumed = out[0]
    assert resumed >= released[0], (resumed, released)
    assert not gate.is_held and gate.wait_open() == 0.0


def test_the_holders_own_thread_and_nested_holds():
    gate = CopyGate(hold_limit_s=30.0)
    with gate.held():
        with gate.held():
            assert gate.wait_open() < 0.05  # the holder may enqueue copies itself
        assert gate.is_held, "the outer hold ended with the inner one"
        t = _paused(gate.wait_open)
    t.join(5)
    assert not t.is_alive() and not gate.is_held


def test_a_hold_longer_than_the_limit_stalls_a_feeder_once():
    gate = CopyGate(hold_limit_s=0.2)
    with gate.held():
        t, out = _in_thread(lambda: [gate.wait_open() for _ in range(3)])
        t.join(5)
        first, *later = out[0]
        assert 0.15 <= first < 2.0 and all(w < 0.05 for w in later), out  # the rest of this hold: no waits
    with gate.held():  # a new hold pauses the feeder again
        t, out = _in_thread(gate.wait_open)
        t.join(5)
        assert out[0] >= 0.15, out


class _DoneEvent:
    def synchronize(self) -> None:
        pass


def test_a_copy_window_admits_no_chunk_while_the_trainer_holds_the_gate():
    window = staging.CopyWindow(64)
    window.add(48, _DoneEvent())
    admitted = threading.Event()
    with GATE.held():
        t = threading.Thread(target=lambda: (window.admit(32), admitted.set()))
        t.start()
        assert not admitted.wait(0.3), "a chunk was admitted while the trainer held the gate"
    assert admitted.wait(5), "the window stayed closed after the hold"
    t.join(5)


def test_a_holder_waiting_for_a_save_lifts_its_hold():
    """A trainer that holds the gate and waits on the host for a save (DeepSpeed's commit inside its step)
    must not wait for copies its own hold keeps back: ``wait_future`` lifts the hold meanwhile."""
    import concurrent.futures as cf

    from cpuckpt.transfer.threads import wait_future

    staged: cf.Future = cf.Future()

    def feeder() -> None:  # a copy that needs the gate open, then the save's staging is done
        GATE.wait_open()
        staged.set_result("staged")

    with GATE.held():
        t = threading.Thread(target=feeder)
        t0 = time.monotonic()
        t.start()
        assert wait_future(staged, 10.0, "staging") == "staged"
        waited = time.monotonic() - t0
        assert waited < 1.0, f"the holder waited {waited:.2f} s for copies its own hold kept back"
        late = _paused(GATE.wait_open)  # the lift ended with the wait: feeders pause again
    late.join(5)
    t.join(5)


def test_lifting_without_holding_changes_nothing():
    gate = CopyGate(hold_limit_s=30.0)
    with gate.lifted():
        assert not gate.is_held and gate.wait_open() == 0.0
    with gate.held():
        def lift_elsewhere() -> None:
            with gate.lifted():  # another thread's lift is not this hold's
                time.sleep(0.5)

        t, _ = _in_thread(lift_elsewhere)
        t2 = _paused(gate.wait_open)
    t2.join(5)
    t.join(5)


def test_an_expired_hold_frees_every_feeder_and_the_next_hold_counts_anew():
    gate = CopyGate(hold_limit_s=0.3)
    with gate.held():
        t0 = time.monotonic()
        feeders = [_in_thread(lambda: (gate.wait_open(), time.monotonic())) for _ in range(3)]
        for t, _ in feeders:
            t.join(5)
        ends = [out[0][1] - t0 for _, out in feeders]
        assert all(0.25 <= e < 1.5 for e in ends), ends  # one limit, not one per feeder
    with gate.held():  # a new hold pauses again, for its own full limit
        t, out = _in_thread(gate.wait_open)
        t.join(5)
        assert out[0] >= 0.25, out


def test_an_exception_inside_a_hold_releases_it():
    gate = CopyGate(hold_limit_s=30.0)
    try:
        with gate.held():
            raise RuntimeError("optimizer step failed")
    except RuntimeError:
        pass
    assert not gate.is_held and gate.wait_open() == 0.0
