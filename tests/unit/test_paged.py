"""``PagedMap``: the dict API subset the broker core uses, checked against a dict."""

import gc
import random

import msgspec
import pytest

from april_async.broker.paged import PAGE_SIZE, PagedMap


class _Record(msgspec.Struct, gc=False):
    value: int


def test_it_behaves_as_a_dict_through_random_inserts_updates_and_removals():
    rng = random.Random(7)
    m, d = PagedMap(), {}
    next_id = 0
    for step in range(40_000):
        r = rng.random()
        if r < 0.45 or not d:  # a new id, above every id so far
            next_id += rng.choice((1, 1, 1, 3, PAGE_SIZE))
            m[next_id] = d[next_id] = step
        elif r < 0.55:  # a new value for a present key
            k = rng.choice(list(d)) if step % 100 == 0 else next_id if next_id in d else min(d)
            m[k] = d[k] = -step
        elif r < 0.8:
            k = min(d) if rng.random() < 0.7 else rng.choice(list(d))
            assert m.pop(k) == d.pop(k)
        elif r < 0.9:
            k = min(d)
            del m[k], d[k]
        else:
            k = rng.randrange(next_id + 2)
            assert (k in m) == (k in d) and m.get(k) == d.get(k) and m.get(k, "no") == d.get(k, "no")
            assert m.pop(k, "gone") == d.pop(k, "gone")
        if step % 997 == 0:
            assert len(m) == len(d) and bool(m) == bool(d) and m == d
            assert list(m) == list(d) and list(m.keys()) == list(d)
            assert list(m.items()) == list(d.items()) and list(m.values()) == list(d.values())
    assert list(m.items()) == list(d.items())


def test_pages_follow_the_live_ids_and_empty_ones_are_dropped():
    m = PagedMap.fromkeys(range(3 * PAGE_SIZE))
    assert len(m.pages) == 3 and len(m) == 3 * PAGE_SIZE
    for k in range(PAGE_SIZE + 1):
        del m[k]
    assert sorted(m.pages) == [1, 2] and len(m) == 2 * PAGE_SIZE - 1
    for k in range(PAGE_SIZE + 1, 3 * PAGE_SIZE):
        m.pop(k)
    assert m.pages == {} and len(m) == 0 and not m and list(m) == []


def test_missing_keys_raise_key_error_naming_the_key():
    m = PagedMap.of({5: "a"})
    with pytest.raises(KeyError) as e:
        m[5 + PAGE_SIZE]  # its page does not exist
    assert e.value.args == (5 + PAGE_SIZE,)
    with pytest.raises(KeyError) as e:
        m[6]  # its page does
    assert e.value.args == (6,)
    with pytest.raises(KeyError):
        m.pop(6)
    with pytest.raises(KeyError):
        del m[7 * PAGE_SIZE]
    assert m == {5: "a"} and m.pop(6, None) is None


def test_order_is_a_dicts_while_ids_only_grow():
    """Iteration is by page, then insertion order in a page: the insertion order of a dict as long as
    no key goes in below one inserted before it (a key removed and inserted again does)."""
    ids = [3, 4, 9, PAGE_SIZE + 1, 5 * PAGE_SIZE, 5 * PAGE_SIZE + 2]
    m, d = PagedMap.fromkeys(ids, 0), dict.fromkeys(ids, 0)
    m[4] = d[4] = 1  # an update keeps its place
    assert list(m.items()) == list(d.items())
    del m[4], d[4]
    m[4] = d[4] = 2  # re-inserted: a dict puts it last, the map in its page
    assert list(m) == [3, 9, 4, PAGE_SIZE + 1, 5 * PAGE_SIZE, 5 * PAGE_SIZE + 2] and list(d)[-1] == 4


def test_equality_and_a_bound_getitem_as_a_sort_key():
    m = PagedMap.of([(10, 2), (2, 0), (PAGE_SIZE * 9, 1)])
    assert m == {2: 0, 10: 2, PAGE_SIZE * 9: 1} and m == PagedMap.of({2: 0, PAGE_SIZE * 9: 1, 10: 2})
    assert m != {2: 0, 10: 2} and m != {2: 0, 10: 2, PAGE_SIZE * 9: 5} and m != PagedMap() and m != [2, 10]
    assert sorted(m, key=m.__getitem__) == [2, PAGE_SIZE * 9, 10]
    assert repr(PagedMap.of({1: "x"})) == "PagedMap({1: 'x'})"
    with pytest.raises(TypeError):
        hash(m)


def test_the_collector_tracks_only_the_dict_of_pages():
    m = PagedMap()
    for k in range(4 * PAGE_SIZE):
        m[k] = _Record(k) if k % 2 else k
    assert not gc.is_tracked(m)
    assert not any(gc.is_tracked(page) for page in m.pages.values())


def test_pop_each_and_values_of_are_pop_and_getitem_over_keys_across_pages():
    """The bulk calls of a delivered group: the values in the order of the keys, emptied pages
    dropped, a missing key a ``KeyError`` naming it (or ``default`` for ``pop_each``)."""
    m = PagedMap.of((k, k * 10) for k in range(PAGE_SIZE - 3, PAGE_SIZE + 5))
    d = {k: k * 10 for k in m}
    keys = list(range(PAGE_SIZE - 3, PAGE_SIZE + 2))  # across the page boundary
    assert m.values_of(keys) == [d[k] for k in keys]
    with pytest.raises(KeyError) as e:
        m.values_of([PAGE_SIZE, 5])
    assert e.value.args == (5,)
    assert m.pop_each(keys) == [d.pop(k) for k in keys]
    assert m == d and set(m.pages) == {1}  # page 0 emptied, so dropped
    a, b = PAGE_SIZE + 2, PAGE_SIZE + 3
    assert m.pop_each([a, 99, b], None) == [d.pop(a), None, d.pop(b)]
    assert m == d
    with pytest.raises(KeyError) as e:
        m.pop_each([PAGE_SIZE + 4, 7])
    assert e.value.args == (7,) and PAGE_SIZE + 4 not in m  # the keys before the missing one are gone
    assert m.pop_each([]) == [] and not m and m.pages == {}


def test_a_fifo_set_takes_its_oldest_members_in_one_walk():
    from april_async.broker.paged import FifoSet, PagedFifoSet

    for kind in (FifoSet, PagedFifoSet):
        q = kind(range(10))
        q.pop(2)
        q.pop(0)
        q[0] = None  # re-added: now the newest
        assert q.take(3) == [1, 3, 4] and list(q) == [5, 6, 7, 8, 9, 0]
        assert 1 not in q and len(q) == 6 and q.first() == 5
        assert q.take(100) == [5, 6, 7, 8, 9, 0] and not q and q.take(1) == []
        q[11] = None
        assert q.first() == 11 and list(q) == [11]
