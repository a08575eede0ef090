"""The committer's relay of write results (:class:`cpuckpt.background._ResultsRelay`): a reused layout's results
travel once; a marker the coordinator cannot resolve fails the commit instead of committing stale results."""

from __future__ import annotations

from cpuckpt.background import _ResultsRelay

UNCHANGED = _ResultsRelay.UNCHANGED


def test_the_same_list_travels_once_and_the_coordinator_resolves_it():
    mine, theirs = ["r0"], ["r1"]
    coordinator, other = _ResultsRelay(), _ResultsRelay()
    first = [coordinator.outgoing(mine), other.outgoing(theirs)]
    assert first == [mine, theirs]
    assert coordinator.incoming(first, mine, coordinator=True) == [mine, theirs]
    assert other.incoming(first, theirs, coordinator=False) is None  # only the coordinator commits from them
    again = [coordinator.outgoing(mine), other.outgoing(theirs)]
    assert again == [UNCHANGED, UNCHANGED]
    assert coordinator.incoming(again, mine, coordinator=True) == [mine, theirs]
    changed = ["r1 again"]  # an equal but new list (a new layout) travels whole
    assert other.outgoing(changed) is changed
    assert coordinator.incoming([UNCHANGED, changed], mine, coordinator=True) == [mine, changed]


def test_a_marker_without_a_kept_copy_resolves_to_nothing_and_forget_sends_whole_again():
    mine, theirs = ["r0"], ["r1"]
    relay = _ResultsRelay()
    assert relay.incoming([mine, UNCHANGED], mine, coordinator=True) is None  # rank 1's copy is unknown here
    assert relay.incoming([UNCHANGED, theirs], mine, coordinator=True) == [mine, theirs]  # rank 0's was kept
    relay.forget()  # after a failed save: this rank sends whole, the coordinator still resolves the others
    assert relay.outgoing(mine) is mine
    assert relay.incoming([mine, UNCHANGED], mine, coordinator=True) == [mine, theirs]
    relay.clear()  # the stream closed
    assert relay.incoming([UNCHANGED, UNCHANGED], mine, coordinator=True) is None
    assert relay.outgoing(None) is None
