"""A map from int ids to values that grows and shrinks a page at a time, never all at once.

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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
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
