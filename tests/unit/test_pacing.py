"""The pacer (``transfer.pacing``): one piece in flight, ticks from module hooks, drains before waits.

The jobs and their events are stand-ins (a piece's event completes when the test says so); the GPU test
(tests/gpu/test_paced_gpu.py) runs real device-to-host copies through ``SaveJob``.
"""

from __future__ import annotations

import threading
import time

import torch

from cpuckpt.transfer.pacing import Pacer


class Event:
    def __init__(self) -> None:
        self.complete = False

    def query(self) -> bool:
        return self.complete


class Job:
    """``pieces`` pieces; every advance is logged as (name, k), the end as (name, "end")."""

    def __init__(self, name: str, pieces: int, log: list, fail_at: int | None = None) -> None:
        self.name, self.left, self.log, self.fail_at = name, pieces, log, fail_at
        self.events: list[Event] = []
        self.aborted: BaseException | None = None
        self.owner = 0

    def advance(self) -> Event | None:
        if self.left == 0:
            self.log.append((self.name, "end"))
            return None
        if self.fail_at == len(self.events):
            raise RuntimeError("enqueue failed")
        self.left -= 1
        self.log.append((self.name, len(self.events)))
        self.events.append(Event())
        return self.events[-1]

    def abort(self, error: BaseException) -> None:
        self.aborted = error
        self.log.append((self.name, "aborted"))


def _hooks() -> int:
    return len(torch.nn.modules.module._global_forward_hooks)


def test_one_piece_in_flight_then_the_next_job():
    log: list = []
    p = Pacer(idle_s=60)  # no watch-thread drain within the test
    a, b = Job("a", 2, log), Job("b", 1, log)
    p.submit(a)
    p.submit(b)
    assert log == [("a", 0)], "the first piece goes at once; b waits behind a's piece in flight"
    p.tick()
    assert log == [("a", 0)], "a tick while the piece before is in flight enqueues nothing"
    a.events[0].complete = True
    p.tick()
    assert log == [("a", 0), ("a", 1)]
    a.events[1].complete = True
    p.tick()  # a ends and b's first piece goes in the same tick
    assert log == [("a", 0), ("a", 1), ("a", "end"), ("b", 0)]
    assert p.pending and p.pieces == 3
    b.events[0].complete = True
    p.tick()
    assert log[-1] == ("b", "end") and not p.pending and _hooks() == 0


def test_drain_enqueues_every_pending_piece_at_once():
    log: list = []
    p = Pacer(idle_s=60)  # no watch-thread drain within the test
    p.submit(Job("a", 3, log))
    p.submit(Job("b", 2, log))
    p.drain()
    assert log == [("a", 0), ("a", 1), ("a", 2), ("a", "end"), ("b", 0), ("b", 1), ("b", "end")]
    assert not p.pending and _hooks() == 0


def test_a_failing_piece_aborts_its_job_and_never_raises_into_the_trainer():
    log: list = []
    p = Pacer(idle_s=60)  # no watch-thread drain within the test
    bad, good = Job("bad", 3, log, fail_at=1), Job("good", 1, log)
    p.submit(bad)
    p.submit(good)
    bad.events[0].complete = True
    p.tick()  # raises inside advance: the tick runs in the trainer's forward, so it must not raise
    assert isinstance(bad.aborted, RuntimeError)
    assert log == [("bad", 0), ("bad", "aborted"), ("good", 0)], log
    p.drain()


def test_module_forward_and_output_gradients_tick_while_copies_are_pending():
    """The global forward hook is there only while a job is pending; backward ticks through the output
    gradients of modules that own parameters."""
    log: list = []
    p = Pacer(idle_s=60)  # no watch-thread drain within the test
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    before = _hooks()
    job = Job("a", 100, log)
    p.submit(job)
    assert _hooks() == before + 1
    job.events[0].complete = True
    orig = job.advance  # from now on every piece completes at once (a fast copy engine): one piece per tick

    def advance() -> Event | None:
        ev = orig()
        if ev is not None:
            ev.complete = True
        return ev

    job.advance = advance  # type: ignore[method-assign]
    x = torch.randn(2, 4, requires_grad=True)
    y = model(x).sum()
    forward = p.pieces
    assert forward == 1 + 4, "one tick per module forward (the Sequential and its 3 modules)"
    y.backward()
    assert p.pieces == forward + 2, "one tick per output gradient of the two Linear modules"
    p.drain()
    assert not p.pending and _hooks() == before
    model(x).sum().backward()
    assert p.pieces == forward + 2 + (100 - forward - 2), "no ticks once nothing is pending"


def test_drain_for_wait_drains_only_on_the_thread_that_submitted():
    log: list = []
    p = Pacer(idle_s=60)  # no watch-thread drain within the test
    p.submit(Job("a", 3, log))
    other = threading.Thread(target=p.drain_for_wait)
    other.start()
    other.join()
    assert log == [("a", 0)], "another thread's wait waits for the trainer's ticks"
    p.drain_for_wait()
    assert log[-1] == ("a", "end") and not p.pending



def test_the_watch_thread_drains_when_the_trainer_makes_no_tick():
    """A trainer waiting in a framework's own finalize makes no tick: the copies go anyway, within ~idle_s."""
    log: list = []
    p = Pacer(idle_s=0.05)
    p.submit(Job("a", 3, log))
    for _ in range(200):
        if not p.pending:
            break
        time.sleep(0.01)
    assert log[-1] == ("a", "end") and not p.pending, log
