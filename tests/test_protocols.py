"""The protocols name what both caches offer: every member exists on each class, a property where the protocol
has one, a method with a signature that accepts every call the protocol's allows."""

import inspect
import re

import numpy as np
import pytest

from pagedrt import PagedKVCache
from pagedrt.memory.backends import Backend
from pagedrt.memory.host import HostBackend
from pagedrt.memory.vmm import CudaBackend
from pagedrt.protocols import KVCache, KVPlanes
from pagedrt.shard import Shard, ShardedKVCache

SHAPE = (2, 4, 64, 16)


def members(protocol):
    """{name: the protocol's attribute} for every member the protocol itself declares."""
    skip = {"__init__", "__subclasshook__", "__class_getitem__", "__init_subclass__"}
    return {name: value for name, value in vars(protocol).items()
            if (not name.startswith("_") or name in ("__enter__", "__exit__"))
            and name not in skip and (callable(value) or isinstance(value, property))}


def accepts(signature, required):
    """Whether a method of ``signature`` takes every call the protocol's ``required`` signature allows: each of
    its parameters by the same name and kind, with the same default; any others optional."""
    params = signature.parameters
    for name, p in required.parameters.items():
        if p.kind is p.VAR_POSITIONAL:
            if not any(q.kind is q.VAR_POSITIONAL for q in params.values()):
                return False
            continue
        q = params.get(name)
        if q is None or q.kind is not p.kind or q.default != p.default:
            return False
    extra = [q for name, q in params.items() if name not in required.parameters]
    return all(q.default is not q.empty or q.kind in (q.VAR_POSITIONAL, q.VAR_KEYWORD) for q in extra)


def unbound(signature):
    """``signature`` without its first parameter (``self``)."""
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def check_member(protocol, cls, instance, name):
    """AssertionError unless ``cls`` (and ``instance``, where one is given) has ``protocol``'s member ``name``: a
    property (or an attribute) where the protocol has a property, else a method or static method that
    :func:`accepts` every call of the protocol's."""
    declared = members(protocol)[name]
    if instance is None:  # by the class alone: an attribute may be one its __init__ sets
        has = hasattr(cls, name) or re.search(rf"\bself\.{name}\b[^=\n]*=[^=]", inspect.getsource(cls.__init__))
    else:
        has = hasattr(instance, name)
    assert has, f"{cls.__name__} lacks {protocol.__name__}.{name}"
    found = inspect.getattr_static(cls, name, None)
    if isinstance(declared, property):
        assert not callable(found), f"{cls.__name__}.{name} must be a property"  # or an attribute
        return
    if isinstance(found, staticmethod):
        signature = inspect.signature(found.__func__)
    else:
        assert inspect.isfunction(found), f"{cls.__name__}.{name} must be a method"
        signature = unbound(inspect.signature(found))
    assert accepts(signature, unbound(inspect.signature(declared))), (
        f"{cls.__name__}.{name}{signature} does not accept every call of "
        f"{protocol.__name__}.{name}{inspect.signature(declared)}")


def check_structure(protocol, cls, instance):
    for name in members(protocol):
        check_member(protocol, cls, instance, name)


@pytest.fixture
def caches():
    whole = PagedKVCache(*SHAPE, max_tokens=256, backend="host")
    sharded = ShardedKVCache(*SHAPE, devices=[0, 1], max_tokens=256, backend="host")
    yield whole, sharded
    whole.close()
    sharded.close()


def test_both_caches_are_a_kv_cache(caches):
    whole, sharded = caches
    check_structure(KVCache, PagedKVCache, whole)
    check_structure(KVCache, ShardedKVCache, sharded)


def test_a_cache_and_each_shard_are_kv_planes(caches):
    whole, sharded = caches
    check_structure(KVPlanes, PagedKVCache, whole)
    for shard in sharded.shards:
        check_structure(KVPlanes, Shard, shard)


def test_both_backends_are_a_backend():
    check_structure(Backend, HostBackend, HostBackend("test"))
    check_structure(Backend, CudaBackend, None)  # by the class: no GPU needed


def test_the_check_refuses_what_does_not_match():
    class Wrong:
        def step(self, seqs, counts=2):  # seqs required, a default changed, the keywords missing
            pass

        def free(self, seqs, now):  # a required parameter more
            pass

        def sequences(self):  # a method where the protocol has a property
            pass

        closed = False  # a class attribute where the protocol has a property: allowed, as an instance's would be

    wrong = Wrong()
    for name, message in (("fork", "lacks"), ("step", "does not accept"), ("free", "does not accept"),
                          ("sequences", "must be a property")):
        with pytest.raises(AssertionError, match=message):
            check_member(KVCache, Wrong, wrong, name)
    check_member(KVCache, Wrong, wrong, "closed")
    assert len(members(KVCache)) >= 25 and len(members(KVPlanes)) == 11 and len(members(Backend)) == 21


def test_sharded_stats_count_the_tables_once_and_bytes_on_every_shard(caches):
    whole, sharded = caches
    for cache in caches:
        cache.step(arrivals=[list(range(40)), list(range(7))])
    one, both = whole.stats(), sharded.stats()
    per_shard = sharded.lead.stats()
    for key in ("sequences", "tokens", "stored_tokens", "held_blocks", "max_blocks"):
        assert both[key] == one[key] == per_shard[key], key
    assert both["token_bytes"] == one["token_bytes"] == 2 * per_shard["token_bytes"]
    assert both["mapped_bytes"] == 2 * per_shard["mapped_bytes"]
    assert both["reserved_bytes"] == 2 * per_shard["reserved_bytes"]
    assert both["tokens"] == 47 and both["stored_tokens"] == 47
    assert np.array_equal(sharded.lengths(sharded.sequences), [40, 7])
