import pytest

from worker.sessions import SessionLimit, SessionNotFound, SessionStore


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class StateHolder:
    """Stands in for an OpenVINO InferRequest: the store only calls reset_state()."""

    def __init__(self):
        self.resets = 0

    def reset_state(self):
        self.resets += 1


def test_cap_and_close():
    store = SessionStore(StateHolder, max_sessions=2, idle_timeout_s=10)
    store.open("a", 16)
    store.open("b", 16)
    with pytest.raises(SessionLimit, match="2 sessions"):
        store.open("c", 16)
    store.open("a", 16)  # reopening an existing session is not a new one
    assert store.close("a") is not None and store.close("a") is None
    store.open("c", 16)
    assert len(store) == 2
    with pytest.raises(SessionNotFound):
        store.get("a")


def test_sessions_of_a_silent_coordinator_expire():
    """A coordinator that stopped health-checking (it died) loses its sessions after the owner timeout,
    busy or not; another coordinator's, and sessions that name no owner, stay."""
    clock = Clock()
    store = SessionStore(StateHolder, max_sessions=8, idle_timeout_s=600, clock=clock, owner_timeout_s=30)
    store.open("a1", 8, owner="coord-a")
    store.open("b1", 8, owner="coord-b")
    store.open("anon", 8)
    store.merge("ga", ["a1"], 8, owner="coord-a")
    clock.t = 20
    store.renew("coord-b")
    store.get("ga")  # in use, but its coordinator is gone all the same
    clock.t = 31
    assert store.expire() == ["ga"]
    clock.t = 49
    assert store.expire() == []
    clock.t = 51
    assert store.expire() == ["b1"]
    assert [s.session_id for s in store.sessions()] == ["anon"]
    store.renew("coord-b")  # a coordinator that comes back keeps what it makes from then on
    store.open("b2", 8, owner="coord-b")
    clock.t = 70
    assert store.expire() == []


def test_idle_expiry():
    clock = Clock()
    store = SessionStore(StateHolder, max_sessions=4, idle_timeout_s=10, clock=clock)
    store.open("old", 8)
    clock.t = 6
    store.open("new", 8)
    clock.t = 12
    assert store.expire() == ["old"]
    store.get("new")
    clock.t = 21
    assert store.expire() == []
    clock.t = 23
    assert store.expire() == ["new"]


def test_kv_budget_reserves_max_context():
    store = SessionStore(StateHolder, max_sessions=8, idle_timeout_s=10, kv_bytes_per_slot=1024,
                         kv_budget_bytes=100 * 1024)
    store.open("a", 60)
    with pytest.raises(SessionLimit, match=r"KV budget full: .* for 41 slots"):
        store.open("b", 41)
    store.open("b", 40)
    assert store.kv_reserved_bytes == 100 * 1024
    store.open("a", 60)  # reopening replaces its own reservation
    store.close("a")
    store.open("c", 60)


def test_sliding_window_layers_reserve_at_most_twice_held_max():
    """A stage of 3 layers, 2 of them local (fleet_common/sliding_kv.py): a session reserves every slot of the
    global layer, at most 2 x held_max of the local ones."""
    from fleet_common.sliding_kv import sliding_kv

    sliding = sliding_kv(8, [0, 2])
    cap = 2 * sliding.held_max
    store = SessionStore(StateHolder, max_sessions=8, idle_timeout_s=10, kv_bytes_per_slot=3, sliding=sliding,
                         sliding_bytes_per_slot=2, kv_budget_bytes=3 * cap + 1000)
    assert store.kv_bytes(cap) == 3 * cap and store.kv_bytes(cap + 1000) == 3 * cap + 1000
    store.open("a", cap + 1000)
    with pytest.raises(SessionLimit):
        store.open("b", 1)
    assert store.kv_reserved_bytes == 3 * cap + 1000
