"""A block-hash index: vLLM's prefix cache, as an alternative to the radix
tree (``[prefix_cache] plugin = "hash"``).

Each full block is keyed by a chained hash of its tokens and its parent's
hash, computed as vLLM 0.33 computes it with its default
``prefix_caching_hash_algo = "sha256"``::

    hash = sha256(pickle((parent_hash or NONE_HASH, tuple(tokens), extra_keys)))
    NONE_HASH = sha256(pickle($PYTHONHASHSEED if set, else "vllm-none-hash"))

with ``extra_keys = (("cache_salt", salt),)`` on a request's first block when
it has a ``cache_salt``, else ``None``. So the keys are vLLM's: a router that
consumes vLLM's KV events can consume these (``block_hash``), and a cache
keyed by one can be looked up with the other. With ``isolate = "tenant"``
the tenant is one more extra key of the first block (not vLLM's: vLLM has no
tenants).

A lookup walks the prompt's block hashes until one is missing, one dict probe
per block, as vLLM's ``find_longest_cache_hit``; hashes are computed once per
request (sha256 over pickled tokens costs about 1.5 µs a block, the radix
tree compares bytes instead). Reference counts are per block; a block is
evictable at count zero. Removing a block removes its cached descendants,
which no lookup could reach any more.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, PrefixInsert, PrefixMatch, Request

NONE_HASH_SEED = "vllm-none-hash"
MAX_MEMOS = 65_536


def sha256(value) -> bytes:
    """vLLM's ``vllm.utils.hashing.sha256``."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> bytes:
    """The parent hash of a first block, as vLLM derives it for sha256
    (``init_none_hash``): from ``PYTHONHASHSEED`` when it is set (tox sets
    it, for one), else from a fixed seed, so processes agree."""
    return sha256(os.environ.get("PYTHONHASHSEED", NONE_HASH_SEED))


def block_hashes(
    token_ids,
    block_size: int,
    extra_keys=None,
    parent: bytes | None = None,
    start: int = 0,
    stop: int | None = None,
    root: bytes | None = None,
) -> list[bytes]:
    """The chained hashes of the full blocks ``start .. stop`` of
    ``token_ids``, ``parent`` being the hash of block ``start - 1`` and
    ``root`` (default :func:`none_hash`) the parent of block 0."""
    stop = len(token_ids) // block_size if stop is None else stop
    root = root or none_hash()
    out = []
    for page in range(start, stop):
        tokens = tuple(token_ids[page * block_size : (page + 1) * block_size])
        parent = sha256((parent or root, tokens, extra_keys if page == 0 else None))
        out.append(parent)
    return out


def content_keys(hashes: Sequence[bytes]) -> tuple[int, ...]:
    """Each 32-byte hash's key (:attr:`CachedBlock.key`): its first 8 bytes,
    little-endian, as :class:`CachedBlock` keys are made at insertion; read
    as one array of words, not one ``int.from_bytes`` a block: a tier
    lookup asks for a whole prompt's keys at once."""
    words = array("Q", b"".join(hashes))
    if sys.byteorder == "big":
        words.byteswap()
    return tuple(words[::4])


@frozen
class HashSettings:
    #: ``"none"``: all tenants share blocks; ``"tenant"``: tenants never do.
    isolate: str = field(default="none", validator=validators.in_(("none", "tenant")))


class _Evictable:
    """Live view of the blocks at reference count zero."""

    __slots__ = ("_free",)

    def __init__(self, free: dict[int, None]):
        self._free = free

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._free

    def __len__(self) -> int:
        return len(self._free)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._free))


class HashPrefixCache:
    """``[prefix_cache] plugin = "hash"``"""

    Settings = HashSettings

    def __init__(self, settings: HashSettings, context: PluginContext):
        self.block_size = context.block_size
        self.isolate_tenants = settings.isolate == "tenant"
        self.root = none_hash()
        self._by_hash: dict[bytes, CachedBlock] = {}
        self._hash_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._children: dict[int, set[int]] = {}
        self._free: dict[int, None] = {}  # refcount zero, insertion-ordered
        self._held: dict[str, list[int]] = {}
        # request id -> (its extra keys, the block hashes computed so far,
        # their content keys: converted as they are hashed, so a tier lookup
        # only slices them); bounded, for requests looked up and never admitted
        self._hashes: OrderedDict[str, tuple[tuple | None, list[bytes], list[int]]] = OrderedDict()
        self._view = _Evictable(self._free)

    # ------------------------------------------------------------ helpers --

    def _extra_keys(self, request: Request) -> tuple | None:
        keys = []
        if self.isolate_tenants:
            keys.append(("tenant", request.tenant))
        if request.cache_salt:
            keys.append(("cache_salt", request.cache_salt))
        return tuple(keys) or None

    def _request_hashes(self, request: Request, token_ids, num_pages: int) -> list[bytes]:
        """The first ``num_pages`` block hashes of ``token_ids``, extending
        what was computed for this request before (its prompt, then its
        output as it is cached)."""
        return self._memo(request, token_ids, num_pages)[1][:num_pages]

    def _memo(self, request: Request, token_ids, num_pages: int) -> tuple[tuple | None, list[bytes], list[int]]:
        """``request``'s memo, its hashes (and their keys) extended to ``num_pages``."""
        memo = self._hashes.get(request.request_id) or (self._extra_keys(request), [], [])
        extra, hashes, keys = memo
        if len(hashes) < num_pages:
            parent = hashes[-1] if hashes else None
            new = block_hashes(token_ids, self.block_size, extra, parent, len(hashes), num_pages, self.root)
            hashes += new
            keys += content_keys(new)
        self._hashes[request.request_id] = memo
        if len(self._hashes) > MAX_MEMOS:
            self._hashes.popitem(last=False)
        return memo

    def _match(self, hashes: list[bytes]) -> list[CachedBlock]:
        matched = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            matched.append(block)
        return matched

    def _ref(self, block_id: int) -> bool:
        """Take a reference; True if the block was evictable."""
        self._refs[block_id] += 1
        if block_id in self._free:  # a block just adopted was never free
            del self._free[block_id]
            return True
        return False

    def _limit(self, request: Request) -> int:
        # At least one prompt token is always computed (vLLM, LMDeploy).
        return (request.num_prompt_tokens - 1) // self.block_size

    def _namespace(self, request: Request) -> str:
        extra = self._extra_keys(request)
        return ";".join(f"{k}={v}" for k, v in extra) if extra else ""

    # -------------------------------------------------------------- hooks --

    @hookimpl
    def sagellm_lookup_prefix(self, request: Request) -> PrefixMatch:
        limit = self._limit(request)
        if limit <= 0:
            return PrefixMatch()
        hashes = self._request_hashes(request, request.prompt_token_ids, limit)
        return PrefixMatch(tuple(self._match(hashes)))

    @hookimpl
    def sagellm_acquire_prefix(self, request: Request) -> PrefixMatch:
        if request.request_id in self._held:
            raise ValueError(f"request {request.request_id!r} already holds a prefix")
        limit = self._limit(request)
        matched = self._match(self._request_hashes(request, request.prompt_token_ids, limit)) if limit > 0 else []
        for block in matched:
            self._ref(block.block_id)
        self._held[request.request_id] = [b.block_id for b in matched]
        return PrefixMatch(tuple(matched))

    @hookimpl
    def sagellm_insert_prefix(
        self, request: Request, token_ids: Sequence[int], block_ids: Sequence[int]
    ) -> PrefixInsert:
        hashes = self._request_hashes(request, token_ids, len(block_ids))
        held = self._held.setdefault(request.request_id, [])
        namespace = self._namespace(request)
        tenant = request.tenant if self.isolate_tenants else None
        adopted, replaced, locked = [], [], []
        parent: CachedBlock | None = None
        for page, (h, given) in enumerate(zip(hashes, block_ids)):
            block = self._by_hash.get(h)
            if block is None:
                block = CachedBlock(
                    given, page, parent.block_id if parent else None, int.from_bytes(h[:8], "little"), namespace, tenant
                )
                self._by_hash[h] = block
                self._hash_of[given] = h
                self._refs[given] = 0
                self._children[given] = set()
                if parent is not None:
                    self._children[parent.block_id].add(given)
                adopted.append(block)
            elif block.block_id != given:
                replaced.append((given, block))
            if page >= len(held):
                # The request's hold grows to this block: newly adopted blocks
                # are counted as the request's own; cached ones it now locks.
                if self._ref(block.block_id):
                    locked.append(block)
                held.append(block.block_id)
            parent = block
        return PrefixInsert(tuple(adopted), tuple(replaced), tuple(locked))

    @hookimpl
    def sagellm_release_prefix(self, request: Request) -> tuple[CachedBlock, ...]:
        self._hashes.pop(request.request_id, None)
        held = self._held.pop(request.request_id, None)
        if not held:
            return ()
        freed = []
        for block_id in held:
            count = self._refs[block_id] - 1
            self._refs[block_id] = count
            if count == 0:
                self._free[block_id] = None
                freed.append(self._by_hash[self._hash_of[block_id]])
        return tuple(freed)  # chain order, root first

    @hookimpl
    def sagellm_evictable_blocks(self) -> _Evictable:
        return self._view

    @hookimpl
    def sagellm_block_keys(self, request: Request, start: int, num_blocks: int) -> tuple[int, ...]:
        num_blocks = min(num_blocks, request.num_prompt_tokens // self.block_size)
        keys = self._memo(request, request.prompt_token_ids, num_blocks)[2]  # memoised per request
        return tuple(keys[start:num_blocks])

    @hookimpl
    def sagellm_remove_blocks(self, block_ids: Sequence[int]) -> tuple[CachedBlock, ...]:
        for block_id in block_ids:
            if block_id not in self._free:
                raise ValueError(f"block {block_id} is not an evictable cached block")
        removed: list[CachedBlock] = []
        for block_id in block_ids:
            if block_id not in self._hash_of:
                continue  # went with an ancestor named earlier in this call
            stack = [block_id]
            while stack:
                b = stack.pop()
                stack.extend(self._children.pop(b))
                h = self._hash_of.pop(b)
                block = self._by_hash.pop(h)
                if block.parent_id in self._children:
                    self._children[block.parent_id].discard(b)
                del self._refs[b]
                self._free.pop(b, None)
                removed.append(block)
        return tuple(removed)

    @hookimpl
    def sagellm_move_blocks(self, moves: Sequence[tuple[int, int]]) -> tuple[CachedBlock, ...]:
        for src, dst in moves:
            if src not in self._free or dst in self._hash_of:
                raise ValueError(f"block {src} is not an evictable cached block, or {dst} is cached")
        moved = dict(moves)
        affected = set(moved).union(*(self._children[src] for src in moved))
        records = {b: self._by_hash[self._hash_of[b]] for b in affected}
        hash_of, refs, children = self._hash_of, self._refs, self._children
        kids = {b: children.pop(b) for b in moved}
        for src, dst in moves:
            hash_of[dst], refs[dst] = hash_of.pop(src), refs.pop(src)
            children[dst] = {moved.get(c, c) for c in kids[src]}
            parent = records[src].parent_id
            if parent is not None and parent not in moved:
                children[parent].discard(src)
                children[parent].add(dst)
        changed = []
        for old_id, block in records.items():
            new_id = moved.get(old_id, old_id)
            record = CachedBlock(
                new_id,
                block.depth,
                moved.get(block.parent_id, block.parent_id),
                block.key,
                block.namespace,
                block.tenant,
            )  # type: ignore[arg-type]
            self._by_hash[hash_of[new_id]] = record
            changed.append(record)
        order = [moved.get(b, b) for b in self._free]
        self._free.clear()  # in place: the evictable view reads this dict
        self._free.update(dict.fromkeys(order))
        return tuple(changed)

    # ------------------------------------------------------------ queries --

    def refcount(self, block_id: int) -> int:
        """Requests holding ``block_id`` (for tests and tools)."""
        return self._refs[block_id]

    def block_hash(self, block_id: int) -> bytes:
        """vLLM's ``BlockHash`` of a cached block."""
        return self._hash_of[block_id]

    def __len__(self) -> int:
        return len(self._by_hash)
