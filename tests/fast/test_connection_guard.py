"""The connection cap's choice of which connection to close, without a server."""

from __future__ import annotations

from infinity.api.connections import ConnectionGuard, ConnectionLimits, Phase


class FrozenClockLoop:
    """uvloop's clock: it ticks in milliseconds, so a burst of accepts reads one time."""

    def time(self) -> float:
        return 100.0


class StandInConnection:
    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard
        self.phase = Phase.HEADERS
        self.since = 0.0
        self.entered = 0
        self.closed = False

    def enter(self, phase: Phase) -> None:
        self.phase = phase
        self.since = self._guard.now()
        self.entered = self._guard.next_entry()

    def close_now(self, answer_late: bool) -> None:
        self.closed = True


def guard_with_cap(cap: int) -> ConnectionGuard:
    guard = ConnectionGuard(ConnectionLimits(header_timeout=4, body_timeout=2, keepalive_timeout=3,
                                             max_connections=cap))
    guard._loop = FrozenClockLoop()  # type: ignore[assignment]
    return guard


def test_at_the_cap_the_connections_that_came_first_are_closed_first_even_on_one_clock_tick():
    guard = guard_with_cap(5)
    connections = [StandInConnection(guard) for _ in range(12)]
    for connection in connections:
        assert guard.admit(connection)  # type: ignore[arg-type]
    assert [c.closed for c in connections] == [True] * 7 + [False] * 5
    assert guard.open_connections == 5


def test_a_connection_inside_a_request_is_never_closed_for_a_new_one():
    guard = guard_with_cap(2)
    busy, waiting, newcomer = (StandInConnection(guard) for _ in range(3))
    assert guard.admit(busy) and guard.admit(waiting)  # type: ignore[arg-type]
    busy.enter(Phase.BUSY)
    assert guard.admit(newcomer)  # type: ignore[arg-type]
    assert waiting.closed and not busy.closed


def test_an_idle_connection_that_waited_longer_goes_before_one_sending_headers():
    guard = guard_with_cap(2)
    first, second, newcomer = (StandInConnection(guard) for _ in range(3))
    assert guard.admit(first) and guard.admit(second)  # type: ignore[arg-type]
    second.enter(Phase.BUSY)
    second.enter(Phase.IDLE)  # answered: now idle, but it began waiting after `first`
    assert guard.admit(newcomer)  # type: ignore[arg-type]
    assert first.closed and not second.closed


def test_with_every_connection_inside_a_request_a_new_one_is_refused():
    guard = guard_with_cap(1)
    busy, newcomer = StandInConnection(guard), StandInConnection(guard)
    assert guard.admit(busy)  # type: ignore[arg-type]
    busy.enter(Phase.BODY)
    assert not guard.admit(newcomer)  # type: ignore[arg-type]
    assert not busy.closed
