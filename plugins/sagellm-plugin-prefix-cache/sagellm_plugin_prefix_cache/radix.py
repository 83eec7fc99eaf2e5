"""A radix tree over token ids with page-aligned edges (SGLang's RadixCache
with ``page_size > 1``, keyed by whole pages).

Each node holds one edge: a run of pages (``block_size`` tokens each, as
one bytes object) and the physical block holding each page. Children are
keyed by their first page, so a match walks one dict lookup per node and
compares the edge in one memcmp.
A match that ends inside an edge splits it at that page boundary, so that
references are counted per node: ``lock_ref`` counts the requests whose path
runs through the node (vLLM's ``ref_cnt``, SGLang's ``lock_ref``). They are
reference counts, not locks: nothing here is thread-safe, and the runtime
calls it from one thread.

Namespaces: each has its own tree, so requests share blocks only within one.
A request's namespace is its ``cache_salt`` (as vLLM's), and with
``isolate = "tenant"`` its tenant too. The namespace seeds the chain keys.

KV events: with ``events = "FILE"`` every change is appended to FILE as a
JSON line (FILE relative to the config's folder and inside it: no absolute
path, no ``..``; opened at the first event, so ``sagellm config check``
creates nothing), as vLLM's KV events (``BlockStored`` / ``BlockRemoved``) let a
router track which engine holds which prefix:
``{"type": "stored", "namespace": ..., "parent": KEY|null, "keys": [...], "block_size": N}``
and ``{"type": "removed", "keys": [...]}``, one line per hook call.

A block is evictable when its node is unlocked. Evicting block ``b`` drops
the pages of its edge from ``b`` on, and the whole subtree below: a block is
worth nothing once its parent is gone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from itertools import repeat
from pathlib import Path

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.errors import ConfigError
from sagellm_core.types import ROOT_KEY, CachedBlock, PrefixInsert, PrefixMatch, Request, chain_key

# The slots of CachedBlock's fields (a frozen attrs class), set directly.
_BLOCK_ID, _DEPTH, _PARENT_ID, _KEY, _NAMESPACE, _TENANT = (
    CachedBlock.__dict__[name] for name in ("block_id", "depth", "parent_id", "key", "namespace", "tenant")
)


class _Block(CachedBlock):
    """A cached block whose content key is computed when it is first read.

    The tree matches prompts by their bytes, not by keys: a key is for the
    plugins that read it (a host tier, ARC's ghosts, KV events), and a run
    whose plugins never do (LRU over a radix cache) pays no SHA-256 per page,
    the largest single cost of a cache-only replay. The block keeps its
    page's bytes (the edge they were inserted with) and its parent (a block,
    or the namespace's root key) until then. Equal to, and hashed as, the
    :class:`CachedBlock` with the same fields. Where the plugins read the
    keys of most blocks (ARC's ghosts, a host tier that takes every evicted
    block), deferring them only costs more: the tree counts the keys read
    and computes them at insertion then (:class:`_KeyReads`).
    """

    #: (edge bytes, page start, page end, parent block or root key, the
    #: tree's :class:`_KeyReads`) until the key is known, then None.
    __slots__ = ("_lazy",)

    @property  # type: ignore[override]
    def key(self) -> int:
        lazy = self._lazy
        if lazy is None:
            return _KEY.__get__(self)  # type: ignore[no-any-return]
        chain, up = [self], lazy[3]
        while isinstance(up, _Block) and up._lazy is not None:  # iteratively: chains are long
            chain.append(up)
            up = up._lazy[3]
        lazy[4].read += len(chain)
        key = up if isinstance(up, int) else up.key
        for block in reversed(chain):
            edge, start, end, _, _ = block._lazy
            with memoryview(edge) as raw:
                key = chain_key(key, raw[start:end])  # type: ignore[arg-type]
            _KEY.__set__(block, key)
            _LAZY.__set__(block, None)  # the bytes and the parent are not needed any more
        return key

    @key.setter
    def key(self, value: int) -> None:  # attrs' __init__ (attrs.evolve, unpickling) sets it
        _KEY.__set__(self, value)
        _LAZY.__set__(self, None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CachedBlock):
            return NotImplemented
        return (self.block_id, self.depth, self.parent_id, self.key, self.namespace, self.tenant) == (
            other.block_id,
            other.depth,
            other.parent_id,
            other.key,
            other.namespace,
            other.tenant,
        )

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = CachedBlock.__hash__

    def __repr__(self) -> str:
        return CachedBlock.__repr__(self).replace("_Block(", "CachedBlock(", 1)


_LAZY = _Block.__dict__["_lazy"]


class _KeyReads:
    """How many of the blocks a tree inserted lazily had their keys read:
    while at least half did, the tree computes keys as it inserts (but one
    edge in ``SAMPLE_EVERY``, which stays lazy so the share is still
    measured). Both counts halve past ``WINDOW`` blocks, so the share
    follows the run as it goes (a host tier that stops taking every evicted
    block turns the tree lazy again)."""

    SAMPLE_EVERY = 8
    WINDOW = 1 << 16
    __slots__ = ("read", "inserted", "edges")

    def __init__(self) -> None:
        self.read = self.inserted = self.edges = 0

    def eager(self, num_blocks: int) -> bool:
        """Whether the next edge's ``num_blocks`` keys are computed now."""
        self.edges += 1
        if self.inserted and self.read * 2 >= self.inserted and self.edges % self.SAMPLE_EVERY:
            return True
        self.inserted += num_blocks
        if self.inserted > self.WINDOW:
            self.read, self.inserted = self.read // 2, self.inserted // 2
        return False


def _lazy_block(block_id: int, depth: int, parent_id: int | None, namespace: str, tenant: str | None, lazy) -> _Block:
    """A block with what computes its key (``_Block._lazy``)."""
    block = _Block.__new__(_Block)
    _LAZY.__set__(block, lazy)
    _BLOCK_ID.__set__(block, block_id)
    _DEPTH.__set__(block, depth)
    _PARENT_ID.__set__(block, parent_id)
    _NAMESPACE.__set__(block, namespace)
    _TENANT.__set__(block, tenant)
    return block


class _DepartedKeys:
    """The content keys of blocks the tree removed, found again by their
    tokens: a prompt that comes back after its blocks left the device (to a
    KV store below it) has its keys read off here, with one dict probe and
    one comparison per removed run, instead of one SHA-256 a block.

    A removed run is kept as its pages' bytes, its blocks and its parent
    (a block, or None for the namespace's root), and indexed by (its
    parent's key, its first page) at the next :meth:`find`: by then the
    runtime has read the keys it offered to the stores. A run whose keys
    nobody read (lazy, no store was given it) is dropped there, unhashed.
    Keys are functions of the tokens, so what is found is never wrong, only
    possibly forgotten: two generations of at most half the capacity each,
    the older dropped whole when the newer fills (no per-run bookkeeping)."""

    __slots__ = ("half", "pending", "pages", "index", "older")

    def __init__(self, capacity: int):
        self.half = max(1, capacity // 2)
        self.pending: list[tuple[bytes, list[CachedBlock], CachedBlock | None]] = []
        self.pages = 0
        self.index: dict[tuple[int, bytes], tuple[bytes, tuple[int, ...]]] = {}
        self.older: dict[tuple[int, bytes], tuple[bytes, tuple[int, ...]]] = {}

    def removed(self, edge: bytes, blocks: list[CachedBlock], parent: CachedBlock | None, root_key) -> None:
        """Blocks ``blocks`` (pages ``edge``), children of ``parent``, left the tree."""
        if self.pages + len(blocks) > self.half:
            self.index_pending(root_key)
            self.older, self.index, self.pages = self.index, {}, 0
        self.pending.append((edge, blocks, parent))
        self.pages += len(blocks)

    def index_pending(self, root_key) -> None:
        """Index the removed runs whose keys are known (``root_key(namespace)``: a first block's parent key)."""
        for edge, blocks, parent in self.pending:
            last = blocks[-1]
            if isinstance(last, _Block) and last._lazy is not None:
                continue  # never read: computing it now would be the hashing this saves
            up = root_key(last.namespace) if parent is None else parent.key  # known: an ancestor of a known key
            self.index[up, edge[: len(edge) // len(blocks)]] = (edge, tuple(b.key for b in blocks))
        self.pending.clear()

    def find(self, parent_key: int, page: bytes) -> tuple[bytes, tuple[int, ...]] | None:
        """The removed run after ``parent_key`` whose first page is ``page``: its bytes and keys."""
        return self.index.get((parent_key, page)) or self.older.get((parent_key, page))


class _Node:
    __slots__ = ("parent", "children", "first", "edge", "blocks", "start", "lock_ref", "hits", "pinned")

    def __init__(self, parent: _Node | None, edge: bytes, blocks: list[CachedBlock], start: int):
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        # The edge's pages as one bytes object: a whole edge is matched with
        # one comparison (a memcmp) instead of one per page, and each page's
        # bytes are held once (not also as a bytes object of its own).
        self.edge = edge
        #: The first page: the node's key among its parent's children.
        self.first = edge[: len(edge) // len(blocks)] if blocks else b""
        self.blocks = blocks
        self.start = start  # page index of the edge's first page
        self.lock_ref = 0
        self.hits = 0  # acquisitions whose match covered this node
        self.pinned = False  # holds one lock of its own while pinned


class _Evictable:
    """Live view of the unlocked blocks; O(1) membership and size."""

    __slots__ = ("_cache", "_where")

    def __init__(self, cache: RadixPrefixCache):
        self._cache = cache
        self._where = cache._where  # the same dict, for the hot membership test

    def __contains__(self, block_id: object) -> bool:
        node = self._where.get(block_id)  # type: ignore[arg-type]
        return node is not None and node.lock_ref == 0

    def __len__(self) -> int:
        return self._cache._num_evictable

    def __iter__(self) -> Iterator[int]:
        for block_id, node in self._cache._where.items():
            if node.lock_ref == 0:
                yield block_id


@frozen
class RadixSettings:
    #: ``"none"``: all tenants share one tree; ``"tenant"``: one per tenant.
    isolate: str = field(default="none", validator=validators.in_(("none", "tenant")))
    #: Append KV events (blocks stored / removed) to this file, JSON lines.
    events: str | None = field(default=None, validator=validators.optional(validators.instance_of(str)))
    #: Pin a prefix (never evict it) once this many requests have matched
    #: all of it: the system prompts that every request of an app shares.
    #: 0: never pin.
    pin_after_hits: int = field(default=0, validator=[validators.instance_of(int), validators.ge(0)])
    #: Pinned blocks never exceed this share of the pool.
    max_pinned_share: float = field(
        default=0.1, validator=[validators.instance_of(float), validators.ge(0), validators.le(1)]
    )
    #: Remember the content keys of removed blocks, up to this many times
    #: the pool's blocks, for ``sagellm_block_keys`` (a runtime with KV
    #: stores asks a returning prompt's keys: read off, not hashed again).
    #: Only once keys are asked. 0: never. The memory holds the pages'
    #: tokens, as the tree does: 1.0 adds at most the tree's own bytes.
    departed_keys: float = field(default=1.0, validator=[validators.instance_of(float), validators.ge(0)])


def _events_path(events: str, config_dir: str | None) -> Path:
    """Where the KV events go: with a config file, a path relative to its
    folder that stays inside it (a config cannot make sagellm write
    elsewhere); built without one (from code), the path as given."""
    path = Path(events)
    if config_dir is not None:
        if path.is_absolute() or ".." in path.parts:
            raise ConfigError(f"events = {events!r}: a path inside the config's folder (relative, without '..')")
        path = Path(config_dir) / path
    if not path.parent.is_dir():
        raise ConfigError(f"events = {events!r}: no folder {path.parent}")
    return path


class RadixPrefixCache:
    """``[prefix_cache] plugin = "radix"``"""

    Settings = RadixSettings

    def __init__(self, settings: RadixSettings, context: PluginContext):
        self.block_size = context.block_size
        self.isolate_tenants = settings.isolate == "tenant"
        self._events_path = _events_path(settings.events, context.config_dir) if settings.events else None
        self._events_file = None
        self._roots: dict[str, _Node] = {}
        self._where: dict[int, _Node] = {}
        self._info: dict[int, CachedBlock] = {}
        self._locked: dict[str, _Node] = {}
        self._num_evictable = 0
        self._view = _Evictable(self)
        self.pin_after_hits = settings.pin_after_hits
        self.max_pinned = int(settings.max_pinned_share * context.num_blocks)
        self._pinned: set[_Node] = set()
        self.num_pinned = 0
        self._key_reads = _KeyReads()
        capacity = int(settings.departed_keys * context.num_blocks)
        self._departed = _DepartedKeys(capacity) if capacity else None
        #: Whether ``sagellm_block_keys`` was asked: only then are removed blocks' keys remembered.
        self._keys_asked = False
        #: Counts the changes of the tree's shape (nodes added, split, cut).
        self._shape = 0
        #: The last lookup: (request, shape then, node reached, blocks matched).
        self._last_lookup: tuple[Request, int, _Node, list[CachedBlock]] | None = None

    # ------------------------------------------------------------ helpers --

    def _namespace(self, request: Request) -> str:
        parts = []
        if self.isolate_tenants:
            parts.append(f"tenant={request.tenant}")
        if request.cache_salt is not None:
            parts.append(f"salt={request.cache_salt}")
        return ";".join(parts)

    def _root(self, namespace: str) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node(None, b"", [], 0)
            root.lock_ref = 1  # never evictable, never counted
        return root

    def _root_key(self, namespace: str) -> int:
        return chain_key(ROOT_KEY, namespace.encode()) if namespace else ROOT_KEY

    @staticmethod
    def _bytes(token_ids) -> memoryview:
        """``token_ids``' bytes, without a copy where they are contiguous (a
        token array is; a match reads pages of a prompt of up to millions of
        tokens, and copying it whole for each lookup, lock and insert was a
        large part of their cost)."""
        view = memoryview(token_ids)
        return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())

    def _walk(
        self, root: _Node, token_ids, num_pages: int, split: bool, held: _Node | None = None
    ) -> tuple[_Node, list[CachedBlock]]:
        """Follow ``token_ids``' first ``num_pages`` pages down from ``root``.
        Return the deepest node reached and the matched blocks. With ``split``
        a match ending inside an edge splits it, so the node ends the match.
        ``held``: a node whose path is checked first, with one comparison per
        node and no child lookup (the path a request holds, when it inserts
        its blocks), and followed from its end if it matches."""
        size = self.block_size * token_ids.itemsize  # bytes per page
        node, page, matched = root, 0, []
        if held is not None and held is not root:
            path = []
            while held.parent is not None:
                path.append(held)
                held = held.parent
            end = path[0].start + len(path[0].blocks)
            if held is root and end <= num_pages:
                with self._bytes(token_ids) as raw:
                    if all(n.edge.startswith(raw[n.start * size : (n.start + len(n.blocks)) * size]) for n in path):
                        node, page = path[0], end
                        matched = [b for n in reversed(path) for b in n.blocks]
        if page >= num_pages or not node.children:
            return node, matched
        with self._bytes(token_ids) as raw:
            while page < num_pages:
                at = page * size
                child = node.children.get(bytes(raw[at : at + size]))
                if child is None:
                    break
                edge, pages = child.edge, len(child.blocks)
                end = min(pages, num_pages - page)
                if edge.startswith(raw[at : at + end * size]):
                    j = end
                else:  # the query leaves the edge: find the page where
                    j = 1
                    while j < end and edge[j * size : (j + 1) * size] == raw[at + j * size : at + (j + 1) * size]:
                        j += 1
                if j < pages:
                    if not split:
                        matched.extend(child.blocks[:j])
                        return child, matched
                    child = self._split(child, j)
                matched.extend(child.blocks)
                node, page = child, page + j
        return node, matched

    def _split(self, child: _Node, j: int) -> _Node:
        self._shape += 1
        parent = child.parent
        cut = j * len(child.first)
        mid = _Node(parent, child.edge[:cut], child.blocks[:j], child.start)
        mid.lock_ref = child.lock_ref
        mid.hits = child.hits
        if child.pinned:  # both halves stay pinned, each with its own pin lock
            mid.pinned = True
            self._pinned.add(mid)
        parent.children[mid.first] = mid
        child.blocks = child.blocks[j:]
        child.edge = child.edge[cut:]
        child.first = child.edge[: len(mid.first)]
        child.start += j
        child.parent = mid
        mid.children[child.first] = child
        for block in mid.blocks:
            self._where[block.block_id] = mid
        return mid

    def _lock(self, node: _Node) -> list[_Node]:
        """Lock the path from ``node`` up; return the nodes that were unlocked."""
        taken = []
        while node.parent is not None:
            if node.lock_ref == 0:
                self._num_evictable -= len(node.blocks)
                taken.append(node)
            node.lock_ref += 1
            node = node.parent
        return taken

    def _unlock(self, node: _Node) -> list[_Node]:
        freed = []
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_evictable += len(node.blocks)
                freed.append(node)
            node = node.parent
        return freed

    def _limit(self, request: Request) -> int:
        # At least one prompt token is always computed (vLLM, LMDeploy).
        return (request.num_prompt_tokens - 1) // self.block_size

    # -------------------------------------------------------------- hooks --

    @hookimpl
    def sagellm_lookup_prefix(self, request: Request) -> PrefixMatch:
        root = self._roots.get(self._namespace(request))
        if root is None:
            return PrefixMatch()
        node, matched = self._walk(root, request.prompt_token_ids, self._limit(request), split=False)
        self._last_lookup = (request, self._shape, node, matched)
        return PrefixMatch(tuple(matched))

    @hookimpl
    def sagellm_acquire_prefix(self, request: Request) -> PrefixMatch:
        if request.request_id in self._locked:
            raise ValueError(f"request {request.request_id!r} already holds a prefix")
        root = self._root(self._namespace(request))
        last, self._last_lookup = self._last_lookup, None
        if last is not None and last[0] is request and last[1] == self._shape:
            # The tree has not changed since this request's lookup (an engine
            # that admits as it looks up, as cache-only replay does): its
            # walk is taken, split where the match ends inside an edge.
            node, matched = last[2], last[3]
            if 0 < len(matched) - node.start < len(node.blocks):
                node = self._split(node, len(matched) - node.start)
        else:
            node, matched = self._walk(root, request.prompt_token_ids, self._limit(request), split=True)
        self._lock(node)
        self._locked[request.request_id] = node
        if self.pin_after_hits and matched:
            self._count_hit(node)
        return PrefixMatch(tuple(matched))

    def _count_hit(self, node: _Node) -> None:
        """Count a match covering ``node``'s path; pin the path once it has
        ``pin_after_hits`` and the pinned share allows it."""
        path = []
        while node.parent is not None:
            node.hits += 1
            path.append(node)
            node = node.parent
        for depth_first in range(len(path)):
            candidate = path[depth_first]
            if candidate.pinned:
                return  # and so are its ancestors
            if candidate.hits < self.pin_after_hits:
                continue
            unpinned = [n for n in path[depth_first:] if not n.pinned]
            if self.num_pinned + sum(len(n.blocks) for n in unpinned) > self.max_pinned:
                continue  # try a shorter prefix: an ancestor
            for n in unpinned:  # a pinned node's ancestors are pinned too
                n.pinned = True
                n.lock_ref += 1  # already locked by this request: never 0 -> 1 here
                self._pinned.add(n)
                self.num_pinned += len(n.blocks)
            return

    @hookimpl
    def sagellm_insert_prefix(
        self, request: Request, token_ids: Sequence[int], block_ids: Sequence[int]
    ) -> PrefixInsert:
        num_pages = len(block_ids)
        namespace = self._namespace(request)
        holds = self._locked.get(request.request_id)  # the path it holds is checked, not looked up again
        node, matched = self._walk(self._root(namespace), token_ids, num_pages, split=True, held=holds)
        replaced = tuple((given, held) for given, held in zip(block_ids, matched) if given != held.block_id)
        adopted: tuple[CachedBlock, ...] = ()
        page = len(matched)
        if page < num_pages:
            parent = matched[-1] if matched else None
            parent_id = parent.block_id if parent else None
            up: CachedBlock | int = parent if parent else self._root_key(namespace)
            tenant = request.tenant if self.isolate_tenants else None
            blocks: list[CachedBlock] = []
            size = self.block_size * token_ids.itemsize  # bytes per page
            new_ids = block_ids[page:num_pages]
            with self._bytes(token_ids) as raw:
                edge = bytes(raw[page * size : num_pages * size])
            at, key_reads = 0, self._key_reads
            if key_reads.eager(len(new_ids)):
                key = up if isinstance(up, int) else up.key
                with memoryview(edge) as pages:
                    for depth, block_id in enumerate(new_ids, page):
                        key = chain_key(key, pages[at : at + size])  # type: ignore[arg-type]
                        blocks.append(CachedBlock(block_id, depth, parent_id, key, namespace, tenant))
                        parent_id, at = block_id, at + size
            else:
                for depth, block_id in enumerate(new_ids, page):
                    up = _lazy_block(
                        block_id, depth, parent_id, namespace, tenant, (edge, at, at + size, up, key_reads)
                    )
                    blocks.append(up)
                    parent_id, at = block_id, at + size
            leaf = _Node(node, edge, blocks, page)
            node.children[leaf.first] = leaf
            self._where.update(zip(new_ids, repeat(leaf)))
            self._info.update(zip(new_ids, blocks))
            self._num_evictable += len(blocks)
            node, adopted = leaf, tuple(blocks)
            self._shape += 1
            if self._events_path:
                self._emit(
                    type="stored",
                    namespace=namespace,
                    parent=parent.key if parent else None,
                    keys=[b.key for b in blocks],
                    block_size=self.block_size,
                )
        # Move the request's lock down to the new end of its path. The old
        # path is a prefix of the new one, so no count falls to zero; blocks
        # of the path that were evictable (cached meanwhile by another
        # request, and released) are locked now.
        taken = self._lock(node)
        old = self._locked.get(request.request_id)
        if old is not None:
            self._unlock(old)
        self._locked[request.request_id] = node
        locked = tuple(b for n in reversed(taken) if n is not node or not adopted for b in n.blocks)
        return PrefixInsert(adopted, replaced, locked)

    @hookimpl
    def sagellm_release_prefix(self, request: Request) -> tuple[CachedBlock, ...]:
        node = self._locked.pop(request.request_id, None)
        if node is None:
            return ()
        freed = self._unlock(node)
        return tuple(block for n in reversed(freed) for block in n.blocks)

    @hookimpl
    def sagellm_evictable_blocks(self) -> _Evictable:
        return self._view

    @hookimpl
    def sagellm_block_keys(self, request: Request, start: int, num_blocks: int) -> tuple[int, ...]:
        namespace = self._namespace(request)
        tokens = request.prompt_token_ids
        num_blocks = min(num_blocks, request.num_prompt_tokens // self.block_size)
        # The cached part of the chain is read off the tree (a byte compare
        # per page); only the pages after it are hashed.
        root = self._roots.get(namespace)
        _, cached = self._walk(root, tokens, start, split=False) if root is not None and start else (None, [])
        key, first = (cached[-1].key, len(cached)) if cached else (self._root_key(namespace), 0)
        out: list[int] = []
        size = self.block_size * tokens.itemsize  # bytes per page
        self._keys_asked = True
        departed = self._departed
        with self._bytes(tokens) as raw:
            if departed is not None and first < num_blocks:
                # Then the pages removed from the tree, as far as they were remembered.
                if departed.pending:
                    departed.index_pending(self._root_key)
                while first < num_blocks:
                    at = first * size
                    found = departed.find(key, bytes(raw[at : at + size]))
                    if found is None:
                        break
                    edge, keys = found
                    end = min(len(keys), num_blocks - first)
                    if edge.startswith(raw[at : at + end * size]):
                        j = end
                    else:  # the prompt leaves the run: find the page where
                        j = 1
                        while j < end and edge[j * size : (j + 1) * size] == raw[at + j * size : at + (j + 1) * size]:
                            j += 1
                    out += keys[max(0, start - first) : j]
                    key, first = keys[j - 1], first + j
            for page in range(first, num_blocks):
                key = chain_key(key, raw[page * size : (page + 1) * size])  # type: ignore[arg-type]
                if page >= start:
                    out.append(key)
        return tuple(out)

    @hookimpl
    def sagellm_pinned_blocks(self) -> tuple[int, ...]:
        return tuple(b.block_id for node in self._pinned for b in node.blocks)

    @hookimpl
    def sagellm_remove_blocks(self, block_ids: Sequence[int]) -> tuple[CachedBlock, ...]:
        where, info = self._where, self._info
        for block_id in block_ids:
            node = where.get(block_id)
            if node is None or node.lock_ref:
                raise ValueError(f"block {block_id} is not an evictable cached block")
        removed: list[CachedBlock] = []
        # Each node's edge is cut once, after the loop: victims trimmed from
        # a chain's leaf name one node many times, and slicing its bytes per
        # victim would copy the edge again each time (quadratic). A later
        # victim in the same node always cuts shallower (the deeper blocks
        # are gone), so the last cut recorded is the one to keep.
        edge_cuts: dict[int, tuple[_Node, int]] = {}
        departed = self._departed if self._keys_asked else None
        at, count = 0, len(block_ids)
        while at < count:
            block_id = block_ids[at]
            at += 1
            node = where.get(block_id)
            if node is None:
                continue  # went with an ancestor named earlier in this call
            blocks = node.blocks
            index = info[block_id].depth - node.start
            gone = blocks[index:]
            if node.children:
                stack = list(node.children.values())
                while stack:
                    sub = stack.pop()
                    stack.extend(sub.children.values())
                    gone.extend(sub.blocks)
                    if departed is not None:
                        self._depart(departed, sub, 0)
                node.children = {}
            # The victims after it that trim this edge on, each the block
            # before the last one cut, leaf first (as LRU names a released
            # chain's blocks): each removes itself alone, so they are taken
            # here in one pass, in the order named.
            while index and at < count and block_ids[at] == blocks[index - 1].block_id:
                index -= 1
                gone.append(blocks[index])
                at += 1
            if departed is not None:
                self._depart(departed, node, index)
            if index == 0:
                del node.parent.children[node.first]
            edge_cuts[id(node)] = (node, index * len(node.first))
            del blocks[index:]
            for block in gone:
                del where[block.block_id], info[block.block_id]
            removed.extend(gone)
        for node, keep in edge_cuts.values():
            node.edge = node.edge[:keep]
        self._num_evictable -= len(removed)
        self._shape += 1
        if self._events_path and removed:
            self._emit(type="removed", keys=[b.key for b in removed])
        return tuple(removed)

    def _depart(self, departed: _DepartedKeys, node: _Node, index: int) -> None:
        """Remember ``node``'s blocks from ``index`` on, about to be removed
        (its edge may still hold pages of blocks removed earlier in the
        same call: its cut waits for the end of the call)."""
        blocks = node.blocks
        size = len(node.first)
        parent = blocks[index - 1] if index else (node.parent.blocks[-1] if node.parent.blocks else None)
        departed.removed(node.edge[index * size : len(blocks) * size], blocks[index:], parent, self._root_key)

    @hookimpl
    def sagellm_move_blocks(self, moves: Sequence[tuple[int, int]]) -> tuple[CachedBlock, ...]:
        where, info = self._where, self._info
        for src, dst in moves:
            node = where.get(src)
            if node is None or node.lock_ref or dst in where:
                raise ValueError(f"block {src} is not an evictable cached block, or {dst} is cached")
        moved = dict(moves)
        # Each moved block, and the block after it in its chain (the next on
        # its edge, or the first of each child edge), gets a new record.
        slots: dict[int, tuple[_Node, int]] = {}
        for src in moved:
            node = where[src]
            index = info[src].depth - node.start
            slots[src] = (node, index)
            if index + 1 < len(node.blocks):
                slots[node.blocks[index + 1].block_id] = (node, index + 1)
            else:
                slots.update((child.blocks[0].block_id, (child, 0)) for child in node.children.values())
        changed = []
        for old_id, (node, index) in slots.items():
            block = node.blocks[index]
            new_id, parent_id = moved.get(old_id, old_id), moved.get(block.parent_id, block.parent_id)  # type: ignore[arg-type]
            lazy = block._lazy if isinstance(block, _Block) else None
            if lazy is None:
                record = CachedBlock(new_id, block.depth, parent_id, block.key, block.namespace, block.tenant)
            else:  # its key is still to compute: from the same bytes and parent record
                record = _lazy_block(new_id, block.depth, parent_id, block.namespace, block.tenant, lazy)
            node.blocks[index] = record
            del where[old_id], info[old_id]
            changed.append((new_id, node, record))
        for new_id, node, record in changed:
            where[new_id], info[new_id] = node, record
        self._shape += 1  # a lookup's blocks are the old records
        return tuple(record for _, _, record in changed)

    def _emit(self, **event) -> None:
        if self._events_file is None:
            # Line-buffered: each event reaches the file (and a tailing router) whole.
            self._events_file = open(self._events_path, "a", encoding="utf-8", buffering=1)
        self._events_file.write(json.dumps(event, separators=(",", ":")) + "\n")

    # ------------------------------------------------------------ queries --

    def refcount(self, block_id: int) -> int:
        """Requests holding ``block_id`` (for tests and tools)."""
        node = self._where[block_id]
        return node.lock_ref - node.pinned

    def __len__(self) -> int:
        return len(self._where)
