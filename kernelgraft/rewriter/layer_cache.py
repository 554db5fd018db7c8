"""A decoder layer's own slot of the KV cache, for layers captured per class (layers.py).

A transformers `Cache` is indexed by each layer's `layer_idx`, a different constant per layer: a
layer graph reading the whole cache would be compiled once per layer. `LayerCache` hands the layer
its own slot instead, whatever index it passes, so one graph serves every layer in decoding too.
"""

from __future__ import annotations

import functools
import weakref

import torch

# the names a decoder layer's call gives the KV cache, across transformers releases
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value")


class LayerCache:
    """One decoder layer's slot of a transformers `Cache`, as that layer reads it: `update` and the
    queries by layer index go to the slot, whatever index the layer passes (the index is the
    layer's own: `with_layer_cache` checks it), so the layer's graph does not depend on it; what
    else the layer asks goes to the whole cache."""

    def __init__(self, cache, slot):
        self.cache, self.slot = cache, slot

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.slot.update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx=0):
        return self.slot.get_seq_length()

    def get_mask_sizes(self, query_length, layer_idx=None):
        return self.slot.get_mask_sizes(query_length)

    def __getattr__(self, name):
        return getattr(self.cache, name)


def with_layer_cache(stack, layer, index: int, kwargs: dict) -> dict:
    """The layer's call with the KV cache it is given replaced by its slot's `LayerCache`, where
    the cache is a transformers `Cache` of per-layer slots that fills them itself (not offloading
    them to the host), and the layer's `layer_idx` (its own or its attention's) is its place in the
    stack; else the call as it is (a graph per layer, each correct)."""
    name = next((k for k in _CACHE_NAMES if kwargs.get(k) is not None), None)
    if name is None:
        return kwargs
    cache = kwargs[name]
    slots = getattr(cache, "layers", None)
    ok = (
        isinstance(slots, list)
        and not getattr(cache, "offloading", False)
        and type(cache).update is _cache_update(type(cache))
        and _layer_index(layer) == index
        and (index < len(slots) or getattr(cache, "layer_class_to_replicate", None) is not None)
    )
    stack.cache_views[0 if ok else 1] += 1
    if not ok:
        return kwargs
    while len(slots) <= index:  # as Cache.update fills a cache made without its slots
        slots.append(cache.layer_class_to_replicate())
    _growing(slots[index])
    return {**kwargs, name: LayerCache(cache, slots[index])}


def _growing(slot) -> None:
    """A filled slot's keys and values grow by a token a step: their length is a dynamic size from
    the first step that reads them, and they are laid out as every later step's concatenation lays
    them (the prompt's are its projections' transposed views), so the layers' decoding graph is
    compiled once, not for the first step and again for the next (`maybe`: where the graph needs
    the length fixed, it stays so). A slot of fixed length (a static cache's) is left as it is."""
    if not _grows(type(slot)):
        return
    for name in ("keys", "values"):
        t = getattr(slot, name, None)
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[-2] > 1:
            if not t.is_contiguous():
                t = t.contiguous()  # the same values; the layout the next step's torch.cat makes
                setattr(slot, name, t)
            torch._dynamo.maybe_mark_dynamic(t, 2)


@functools.cache
def _grows(cls) -> bool:
    """Whether a cache slot of class `cls` grows a token a step: transformers' DynamicLayer and its
    subclasses (a sliding window's, up to its window)."""
    return any(c.__name__ == "DynamicLayer" and "transformers" in c.__module__ for c in cls.__mro__)


@functools.cache
def _cache_update(cls):
    """transformers' `Cache.update` where `cls` is a Cache that keeps it (a subclass with its own
    update may do more than update the slot); None otherwise."""
    base = next((c for c in cls.__mro__ if c.__name__ == "Cache" and "transformers" in c.__module__), None)
    return base.update if base is not None else None


def _layer_index(layer) -> int | None:
    """The `layer_idx` the layer and its submodules hold, where they agree on one; None otherwise.
    Read once per layer: a decoding step calls every layer, and the scan of its modules cost more
    than the rest of the call's Python."""
    known = _INDEX.get(layer)
    if known is None:
        found = {getattr(m, "layer_idx", None) for m in layer.modules()} - {None}
        known = _INDEX[layer] = (found.pop() if len(found) == 1 else None,)
    return known[0]


_INDEX: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
