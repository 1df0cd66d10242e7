"""The prefix cache's choices (coordinator/engine/prefix_cache.py): what a prompt reuses, and what is evicted."""

from types import SimpleNamespace

from coordinator.engine.prefix_cache import PrefixCache, Retained, common_prefix

LIVE = SimpleNamespace(healthy=True)


def cache(**kw):
    freed = []
    clock = [0.0]
    c = PrefixCache(freed.append, clock=lambda: clock[0], **{"min_tokens": 4, "max_tokens": 100, **kw})
    return c, freed, clock


def entry(name, tokens, pipeline=LIVE):
    return Retained(name, pipeline, list(tokens))


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [1]) == 0


def test_next_turn_takes_the_session_and_a_partial_match_copies_it():
    c, freed, _ = cache()
    chat = entry("chat", range(20))
    c.retain(chat)
    hit = c.lookup(list(range(20)) + [99, 98])  # the next turn: extends the chat
    assert (hit.entry, hit.tokens, hit.take) == (chat, 20, True) and c.entries == []
    c.retain(chat)
    edited = list(range(10)) + [77] * 15  # history edited at token 10
    hit = c.lookup(edited)
    assert (hit.tokens, hit.take) == (10, False) and c.entries == [chat] and chat.copying == 1
    assert not c.evict_lru()  # being copied: kept
    c.copied(hit)
    assert chat.copying == 0 and freed == []


def test_one_token_is_always_fed_and_short_prefixes_are_not_reused():
    c, _, _ = cache()
    c.retain(entry("a", range(10)))
    hit = c.lookup(list(range(10)))  # the same prompt again: all but its last token
    assert (hit.tokens, hit.take) == (9, False)
    c.copied(hit)
    assert c.lookup([0, 1, 2, 50, 51]) is None  # 3 < min_tokens


def test_longest_prefix_wins_and_unusable_entries_are_skipped():
    c, _, _ = cache()
    short, long_ = entry("short", range(8)), entry("long", range(16))
    c.retain(short)
    c.retain(long_)
    assert c.lookup(list(range(30)), usable=lambda e: e is not long_).entry is short
    assert c.lookup(list(range(30))).entry is long_


def test_lru_bound_idle_and_dead_pipelines():
    c, freed, clock = cache(max_tokens=30, idle_s=10)
    a, b = entry("a", range(10)), entry("b", range(100, 115))
    c.retain(a)
    clock[0] = 1
    c.retain(b)
    c.lookup(list(range(100, 106)) + [0])  # touches b (a copy of 6 tokens)
    b.copying = 0
    clock[0] = 2
    d = entry("d", range(200, 210))
    c.retain(d)  # 35 > 30 tokens: the least recently used (a) goes
    assert freed == [a] and c.entries == [b, d] and c.held_tokens == 25
    assert c.evictions == 1
    assert not c.retain(entry("huge", range(500, 540)))  # over the bound alone: not kept, nothing evicted
    assert freed == [a] and c.entries == [b, d]
    c2, freed2, clock2 = cache(idle_s=10)
    dead = SimpleNamespace(healthy=False)
    old, gone, fresh = entry("old", range(10)), entry("gone", range(50, 60), dead), entry("new", range(20, 30))
    c2.retain(old)
    clock2[0] = 8
    c2.retain(gone)
    c2.retain(fresh)
    clock2[0] = 12
    c2.sweep()
    assert freed2 == [old, gone] and c2.entries == [fresh]


def test_clear_while_a_copy_is_in_flight_frees_the_entry_once_the_copy_is_done():
    """A re-plan or a shutdown clears the cache while an entry is still being made (its row copied out of its
    batch group) or copied from: closing it then would race the copy, which would open the session again on
    a stage after the close, for nobody to free (a worker kept it until its idle expiry and refused a new
    stage meanwhile). It is freed once done, and matched by nobody meanwhile."""
    c, freed, _ = cache()
    making = entry("making", range(40))
    making.copying = 1  # its own making (coordinator/engine/loop.py _new_entry)
    idle = entry("idle", range(100, 140))
    source = entry("source", range(200, 240))
    for e in (making, idle, source):
        assert c.retain(e)
    hit = c.lookup(list(range(200, 220)) + [7, 8])  # a copy of source's prefix in flight
    assert hit is not None and not hit.take and hit.entry is source
    c.clear()
    assert [e.session_id for e in freed] == ["idle"]
    assert c.lookup(list(range(30)) + [7]) is None  # doomed: never matched again
    c.done_copying(making)
    c.copied(hit)
    assert [e.session_id for e in freed] == ["idle", "making", "source"] and not c.entries
