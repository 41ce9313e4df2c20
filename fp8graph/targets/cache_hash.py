"""Cache keys for fp8graph's graph targets, so AOTAutograd's cache can store their graphs.

A rewritten graph calls Python functions (``fp8graph_linear_...``) that
AOTAutograd traces into its forward and backward graphs. Its cache refuses
functions it cannot vouch for, unless a node carries a ``user_cache_hash``
that identifies what the function computes (the mechanism ``torch.fx.wrap``
functions use). The hash covers the target's name and parameters, the source
of every module of fp8graph (a target's graph is what the GEMM, numerics and
kernel modules it calls trace to, not only the target's own file) and torch's
version, so a changed recipe or a new fp8graph misses the cache instead of
reusing a stale graph. Parameters whose ``repr`` holds a
memory address (a custom ``amax_compute_algo`` function) never match across
processes: those graphs recompile, as before.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import pathlib
from typing import Callable

import torch
import torch.fx

__all__ = ["hashed_sources", "mark_cacheable", "register_target", "source_hash"]


def hashed_sources() -> list[tuple[str, pathlib.Path]]:
    """``(name, path)`` of every source file of fp8graph and of its passes (which install under it from a folder
    of their own), in a fixed order."""
    folders = {package: pathlib.Path(folder).resolve() for package in ("fp8graph", "fp8graph.passes")
               for folder in importlib.import_module(package).__path__}
    return [(f"{package}/{path.relative_to(folder)}", path) for package, folder in sorted(folders.items())
            for path in sorted(folder.rglob("*.py"))]


@functools.cache
def source_hash() -> str:
    """A digest of torch's version and fp8graph's source (:func:`hashed_sources`)."""
    digest = hashlib.sha256(torch.__version__.encode())
    for name, path in hashed_sources():
        digest.update(name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def register_target(target: Callable, *parameters: object) -> Callable:
    """Give ``target`` (named already) its cache hash and an importable name.

    The cache key pickles the graph, and pickle finds a function by module and
    qualified name: each target is published here as ``<name>_<hash prefix>``,
    unique even for recipes whose names agree. ``__name__`` stays readable
    for the graph's code. A target made again with the same identity (a cached
    factory called with its defaults spelled out, or not) is the one published
    first: two functions under one name would make pickle refuse the graphs
    that call the other, and the cache bypass them.
    """
    identity = "\n".join([source_hash(), target.__name__, *map(repr, parameters)])
    cache_hash = hashlib.sha256(identity.encode()).hexdigest()
    qualname = f"{target.__name__}_{cache_hash[:16]}"
    published = globals().get(qualname)
    if published is not None and getattr(published, "cache_hash", None) == cache_hash:
        return published
    target.cache_hash = cache_hash
    target.__module__ = __name__
    target.__qualname__ = qualname
    globals()[qualname] = target
    return target


def mark_cacheable(node: torch.fx.Node, target: Callable) -> None:
    """Let AOTAutograd's cache store graphs that call ``target`` at ``node``."""
    node.meta["is_wrapped"] = True
    node.meta["user_cache_hash"] = target.cache_hash
