"""`Turns`: at most N holders, the rest served in arrival order; `close()` sends waiters away."""

from __future__ import annotations

import threading
import time

import pytest

from distbatch.serving.turns import Turns


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


@pytest.mark.parametrize("count", [1, 2])
def test_turns_go_to_waiters_in_arrival_order_and_never_more_than_n_at_once(count: int) -> None:
    turns = Turns(count)
    for _ in range(count):
        assert turns.take()
    order: list[int] = []
    holding = [0]
    most = [0]
    lock = threading.Lock()

    def waiter(i: int) -> None:
        assert turns.take()
        with lock:
            order.append(i)
            holding[0] += 1
            most[0] = max(most[0], holding[0])
        time.sleep(0.02)
        with lock:
            holding[0] -= 1
        turns.give_back()

    threads = []
    for i in range(6):
        t = threading.Thread(target=waiter, args=(i,))
        t.start()
        threads.append(t)
        wait_until(lambda n=i + 1: turns.waiting() == n)  # queued in this order
    time.sleep(0.05)  # still queued, none took a turn
    assert order == []
    for _ in range(count):
        turns.give_back()
    for t in threads:
        t.join(5)
    if count == 1:
        assert order == list(range(6))  # with more turns, two handed at once may start in either order
    else:
        assert sorted(order) == list(range(6))
    assert most[0] <= count
    assert turns.waiting() == 0
    assert all(turns.take() for _ in range(count))  # every turn is free again


def test_close_sends_waiters_away_without_a_turn_and_refuses_later_takes() -> None:
    turns = Turns(1)
    assert turns.take()
    result: list[bool] = []
    waiters = [threading.Thread(target=lambda: result.append(turns.take())) for _ in range(3)]
    for t in waiters:
        t.start()
    wait_until(lambda: turns.waiting() == 3)
    turns.close()
    for t in waiters:
        t.join(5)
    assert result == [False] * 3 and turns.waiting() == 0
    assert turns.take() is False
    turns.give_back()  # the holder's turn, given back after the close: nothing to hand it to


def test_at_least_one_turn() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Turns(0)
