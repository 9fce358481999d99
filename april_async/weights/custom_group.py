"""A ``torch.distributed`` group formed the way SGLang forms its weight-update group.

SGLang's ``POST /init_weights_update_group`` makes every tensor-parallel worker of a server join
a group with ``rank = rank_offset + tp_rank`` through ``init_custom_process_group`` (read in
sglang 0.5.10.post1, 0.5.15.post1 and 0.5.23, ``python/sglang/srt/utils/common.py``). The recipe:

    1. ``rendezvous("tcp://master_address:master_port", rank, world_size)``: rank 0 hosts the
       TCPStore, every other rank connects to it as a client;
    2. ``PrefixStore(group_name, store)``;
    3. ``_new_process_group_helper(world_size, rank, [], Backend(backend), that store,
       group_name=group_name, timeout=...)`` — an empty rank list, so no default group is needed;
    4. ``_world.pg_group_ranks[pg] = {i: i for i in range(world_size)}``, so that
       ``torch.distributed.broadcast(t, src=0, group=pg)`` maps ranks one to one.

The trainer side (here: the broadcaster) is rank 0 and must build its end with the same store
keys, or the rendezvous never meets. ``join_custom_group`` does exactly those steps; rank 0 may
pass the TCPStore it already hosts instead of an address (the keys live under ``group_name``, so
one store serves any number of groups). The test stand-in server joins with the same function
from the rank side, as SGLang's own code does.

``torch.distributed`` registers a group's name process-wide: every group needs a fresh name, and
``leave_custom_group`` unregisters it (SGLang's ``/destroy_weights_update_group`` does the same).
"""

from __future__ import annotations

import datetime
import inspect

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def join_custom_group(*, backend: str, world_size: int, rank: int, group_name: str, timeout_s: float,
                      init_method: str | None = None, store: dist.Store | None = None):
    """Join (rank 0: host) ``group_name``; blocks until all ``world_size`` ranks arrived.

    Give ``init_method`` (``tcp://host:port``: rank 0 starts the store there) or, for rank 0, a
    ``store`` it already hosts. Returns the process group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        if init_method is None:
            raise ValueError("join_custom_group needs init_method or store")
        store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = dist.PrefixStore(group_name, store)
    helper = c10d._new_process_group_helper
    # torch < 2.6 calls the backend options ``pg_options``; SGLang passes None under either name.
    options = "backend_options" if "backend_options" in inspect.signature(helper).parameters else "pg_options"
    pg, _ = helper(world_size, rank, [], dist.Backend(backend), prefixed, group_name=group_name,
                   timeout=timeout, **{options: None})
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def leave_custom_group(pg) -> None:
    """Unregister and drop ``pg`` (its name may then be used again); never raises."""
    try:
        if pg is not None and pg in c10d._world.pg_map:
            dist.destroy_process_group(pg)
    except Exception:  # a group whose peer died: there is nothing left to tear down cleanly
        pass
