"""The ledger's containers of ids that the garbage collector never walks: ``PagedMap``, ``FifoSet``.

``PagedMap`` is a map from int ids to values that grows and shrinks a page at a time, never all at
once.

A CPython dict keeps all of its keys in one table and rebuilds that table whole when it fills:
when it grows (at 1,000 generators × 64 slots, three of the broker's dicts keyed by sample id grew
in the same ``admit`` at 87,392, 174,768 and 349,536 live samples: 10, 19 and 34–42 ms), and, for
a dict whose keys come and go, every time the deleted entries have used up its spare room (once per
ledger-size of insertions: 14–25 ms of CPU at 384,000 keys). ``PagedMap`` files key ``k`` in a
small dict, the page ``k >> PAGE_BITS``: an insertion rebuilds at most one page of ``PAGE_SIZE``
keys, and a page that empties is dropped, so a map of dense increasing ids (sample ids) holds a few
hundred pages that follow the live range of ids. Each operation costs 40–120 ns more than a dict's
(a Python call): worth it only for maps that reach 100,000 keys or so.

Only the part of the dict API that the broker core uses is here. Keys must be ints. Iteration is by
page, in the order the pages were made, then in insertion order within a page: the same order as a
dict's as long as no key is inserted below a key inserted before it (ids that only grow and are
never re-inserted once removed; replacing the value of a present key moves nothing, as in a dict).

The map is a msgspec ``Struct(gc=False)``: the cyclic garbage collector does not track it, and its
pages, dicts of ints or of untracked records, are not tracked either; only the dict of pages is
(one container of a few hundred entries a map). It holds no reference cycles: store no value that
refers back to the map.

``FifoSet`` is the ledger's queue: an ordered set of ints taken from the front (see there);
``PagedFifoSet`` keeps its membership in a ``PagedMap``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgspec

PAGE_BITS = 10
"""Key ``k`` lives on page ``k >> PAGE_BITS``."""
PAGE_SIZE = 1 << PAGE_BITS
"""The most keys one page holds (what one insertion may rebuild, in place of the whole map)."""

_MISSING: Any = object()
_NO_PAGE: dict[int, Any] = {}  # what a missing page reads as (never written)


class PagedMap(msgspec.Struct, gc=False):
    """A dict of int keys kept as pages of ``PAGE_SIZE`` consecutive keys (see the module docstring)."""

    # page number -> its entries. No count of the keys is kept: ``len`` sums the pages (a few
    # hundred), and the hot paths (``[]``, ``get``, ``in``, insertion, ``pop``) do not pay for one.
    pages: dict[int, dict[int, Any]] = msgspec.field(default_factory=dict)

    @classmethod
    def fromkeys(cls, keys: Iterable[int], value: Any = None) -> PagedMap:
        m = cls()
        for k in keys:
            m[k] = value
        return m

    @classmethod
    def of(cls, items: Iterable[tuple[int, Any]] | Mapping[int, Any]) -> PagedMap:
        """A map holding ``items`` (pairs, or a mapping's items), inserted in their order."""
        m = cls()
        for k, v in (items.items() if isinstance(items, Mapping) else items):
            m[k] = v
        return m

    def __getitem__(self, key: int) -> Any:
        try:
            return self.pages[key >> PAGE_BITS][key]
        except KeyError:
            raise KeyError(key) from None

    def get(self, key: int, default: Any = None) -> Any:
        return self.pages.get(key >> PAGE_BITS, _NO_PAGE).get(key, default)

    def __contains__(self, key: int) -> bool:
        return key in self.pages.get(key >> PAGE_BITS, _NO_PAGE)

    def __setitem__(self, key: int, value: Any) -> None:
        page = self.pages.get(key >> PAGE_BITS)
        if page is None:
            self.pages[key >> PAGE_BITS] = {key: value}
        else:
            page[key] = value

    def pop(self, key: int, default: Any = _MISSING) -> Any:
        p = key >> PAGE_BITS
        page = self.pages.get(p)
        if page is not None:
            value = page.pop(key, _MISSING)
            if value is not _MISSING:
                if not page:
                    del self.pages[p]
                return value
        if default is _MISSING:
            raise KeyError(key)
        return default

    def pop_each(self, keys: Iterable[int], default: Any = _MISSING) -> list[Any]:
        """Remove every key of ``keys`` and return their values in order (``default`` for a missing
        key; none given: each must be present): ``pop`` in one call, for the ids of a group, which
        are consecutive (mostly one page)."""
        pages, out = self.pages, []
        p, page = -1, _NO_PAGE
        for key in keys:
            if key >> PAGE_BITS != p:
                if not page and p in pages:
                    del pages[p]
                p = key >> PAGE_BITS
                page = pages.get(p, _NO_PAGE)
            value = page.pop(key, default) if page else default
            if value is _MISSING:
                raise KeyError(key)
            out.append(value)
        if not page and p in pages:
            del pages[p]
        return out

    def values_of(self, keys: Iterable[int]) -> list[Any]:
        """The values of ``keys`` (each must be present), in order: ``[m[k] for k in keys]`` in one call."""
        pages, out = self.pages, []
        p, page = -1, _NO_PAGE
        try:
            for key in keys:
                if key >> PAGE_BITS != p:
                    p = key >> PAGE_BITS
                    page = pages.get(p, _NO_PAGE)
                out.append(page[key])
        except KeyError as e:
            raise KeyError(e.args[0]) from None
        return out

    def __delitem__(self, key: int) -> None:
        self.pop(key)

    def __len__(self) -> int:
        return sum(map(len, self.pages.values()))

    def __bool__(self) -> bool:
        return bool(self.pages)  # an empty page is dropped at once

    def __iter__(self) -> Iterator[int]:
        for page in self.pages.values():
            yield from page

    def keys(self) -> Iterator[int]:
        return iter(self)

    def values(self) -> Iterator[Any]:
        for page in self.pages.values():
            yield from page.values()

    def items(self) -> Iterator[tuple[int, Any]]:
        for page in self.pages.values():
            yield from page.items()

    def __eq__(self, other: object) -> bool:
        """Equal to a ``PagedMap`` or any mapping with the same keys and values (order aside, as dicts)."""
        if isinstance(other, PagedMap):
            return self.pages == other.pages
        if isinstance(other, Mapping):
            return len(self) == len(other) and all(other.get(k, _MISSING) == v for k, v in self.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dict

    def __repr__(self) -> str:
        return f"PagedMap({dict(self.items())!r})"


class FifoSet:
    """An ordered set of ints taken from the front: O(1) add, remove and first, and nothing for the
    garbage collector to walk.

    The ledger's queues hold up to hundreds of thousands of ids. A plain dict finds its first key by
    skipping every entry deleted before it (O(n) a lease once thousands went out); an
    ``OrderedDict`` follows a link, but it is a container the collector always tracks, and
    visiting its 256,000 ids made half of a 1,000-generator broker's full collections (75 ms).
    Here the order lives in an ``array`` (one object, whose contents the collector never visits)
    and membership in a dict of ints, which the collector stops tracking: each id is appended with
    a stamp, removal only forgets the id, and stale entries are skipped at the front and dropped
    when the array is compacted.
    """

    __slots__ = ("_order", "_members", "_head", "_next")
    _map: type = dict  # what holds the membership

    def __init__(self, ids: Sequence[int] = ()):
        self._order = array("q")  # id, stamp, id, stamp, ...
        self._members = self._map()  # id -> the stamp of its live entry
        self._head = 0  # index in _order of the first entry that may be live
        self._next = 0
        for i in ids:
            self[i] = None

    @classmethod
    def fromkeys(cls, ids: Sequence[int]) -> FifoSet:
        return cls(ids)

    def __setitem__(self, key: int, _value: None) -> None:
        """Add ``key`` at the back (already in: it stays where it is, like a dict's key)."""
        if key in self._members:
            return
        stamp = self._next
        self._next = stamp + 1
        self._members[key] = stamp
        self._order.append(key)
        self._order.append(stamp)

    def pop(self, key: int, default=None):
        return default if self._members.pop(key, _MISSING) is _MISSING else None

    def __delitem__(self, key: int) -> None:
        del self._members[key]

    def __contains__(self, key: int) -> bool:
        return key in self._members

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def _live_head(self) -> int:
        """Skip the dead entries at the front (each is skipped once) and return the index of the
        first live one (the end when none is)."""
        order, members, i, end = self._order, self._members, self._head, len(self._order)
        while i < end and members.get(order[i], -1) != order[i + 1]:  # a removed or re-added id's old entry
            i += 2
        if i > 4096 and i * 2 > end:  # drop the dead front: amortized O(1) per entry
            del order[:i]
            i = 0
        self._head = i
        return i

    def take(self, k: int) -> list[int]:
        """Remove the ``k`` oldest ids (all of them when fewer) and return them, oldest first: what
        ``k`` calls of ``first`` and ``pop`` give, in one walk over slices of the order (a batch's
        4,000 groups from the ready queue at 1,000 generators: 0.5 ms)."""
        order, members = self._order, self._members
        i, out = self._live_head(), []
        while len(out) < k and i < len(order):
            chunk = order[i : i + 2 * (k - len(out))]  # no more entries than ids still wanted
            i += len(chunk)
            for key, stamp in zip(chunk[::2], chunk[1::2]):
                if members.get(key) == stamp:
                    del members[key]
                    out.append(key)
        self._head = i
        return out

    def first(self) -> int:
        """The oldest id (the set must not be empty)."""
        return self._order[self._live_head()]

    def oldest_of(self, keys) -> int | None:
        """Of ``keys``, the member added first (None when none is a member): O(len(keys)), for a
        few candidates picked by something other than their place in the order."""
        members, best, best_stamp = self._members, None, None
        for key in keys:
            stamp = members.get(key)
            if stamp is not None and (best_stamp is None or stamp < best_stamp):
                best, best_stamp = key, stamp
        return best

    def __iter__(self):
        """The ids, oldest first. Dead entries in the middle are skipped as met: a queue whose
        middle is taken (scoring, ready groups) should be read a few ids at a time (``islice``)."""
        order, members = self._order, self._members
        for i in range(self._live_head(), len(order), 2):
            key = order[i]
            if members.get(key, -1) == order[i + 1]:
                yield key


class PagedFifoSet(FifoSet):
    """A ``FifoSet`` whose membership is a ``PagedMap`` (also untracked by the collector), for the
    fresh queue: it holds a quarter of a million ids at 1,000 generators, and as a dict its table was
    rebuilt whole inside an ``admit`` whenever it grew (see ``paged.py``). The small queues keep a
    dict, whose operations are two to four times faster."""

    __slots__ = ()
    _map = PagedMap
