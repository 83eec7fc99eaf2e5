"""Value types exchanged between the runtime and plugins.

Plugins exchange nothing else. Units are always explicit: ``*_blocks`` counts KV
blocks of ``block_size`` tokens, ``*_tokens`` counts tokens, ``*_bytes`` bytes,
``*_s`` seconds (simulated time in replay, wall time in a real engine).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import math
import struct
import zlib
from array import array
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from attrs import define, field, frozen

from sagellm_core.lengths import QUANTILE_LEVELS as QUANTILE_LEVELS
from sagellm_core.lengths import PredictedLengths

TOKEN_ARRAY_TYPECODE = "q"


def as_token_array(values: Any) -> array[int] | None:
    """Token ids are stored as a compact int64 ``array``: a 100k-token prompt as
    a tuple of Python ints costs 3.6 MB, as an array 0.8 MB. A 1-d buffer of
    64-bit integers (an engine's numpy token ids) is taken in one copy, not
    element by element."""
    if values is None:
        return None
    if isinstance(values, array) and values.typecode == TOKEN_ARRAY_TYPECODE:
        return values
    try:
        view = memoryview(values)
    except TypeError:
        if isinstance(values, list) and len(values) > 64:  # an engine's prompt: packed in one C call, not per item
            with contextlib.suppress(struct.error):  # (what is wrong with it, array() says below)
                return array(TOKEN_ARRAY_TYPECODE, struct.pack(f"{len(values)}q", *values))
        return array(TOKEN_ARRAY_TYPECODE, values)
    out = array(TOKEN_ARRAY_TYPECODE)
    if view.ndim == 1 and view.itemsize == out.itemsize and view.format.lstrip("@=<") in ("q", "l"):
        out.frombytes(view.cast("B") if view.c_contiguous else view.tobytes())
        return out
    return array(TOKEN_ARRAY_TYPECODE, values)


def _hint(check: Callable[[Any], bool], accepted: str, flag: bool = False) -> Callable[[Any, Any, Any], None]:
    def validate(instance: Any, attribute: Any, value: Any) -> None:  # an attrs validator naming the field
        with contextlib.suppress(TypeError):  # a value of another type fails the check too
            if isinstance(value, bool) is flag and check(value):  # (True is an int to Python, not a count)
                return
        raise ValueError(f"kv_hints.{attribute.name} = {value!r:.40}: {accepted}")

    return validate


_TOKENS = _hint(lambda v: isinstance(v, int) and v >= 0, "a number of leading prompt tokens (0: none)")
_FLAG = _hint(lambda v: True, "true or false", flag=True)


@frozen
class KVHints:
    """What a client knows about a request's KV that the server cannot (as
    OpenAI's ``prompt_cache_key``, Anthropic's ``cache_control`` TTL): advice
    that plugins may take, none changing what is computed."""

    #: Keep the blocks this request leaves (and their prefix) at least this
    #: many seconds after it ends, ahead of unhinted blocks; 0: none.
    retain_s: float = field(
        default=0.0,
        validator=_hint(lambda v: isinstance(v, (int, float)) and 0 <= v < math.inf, "finite seconds, 0 or more"),
    )
    #: Pin the prompt's first ``pin`` tokens' whole blocks until a request
    #: unpins that prefix or the pin expires; 0: none.
    pin: int = field(default=0, validator=_TOKENS)
    #: Unpin the pin on the prompt's first ``unpin`` tokens; 0: none.
    unpin: int = field(default=0, validator=_TOKENS)
    #: The conversation (``cache_key``, else the session) is over: the blocks
    #: only it used may go first.
    release: bool = field(default=False, validator=_FLAG)
    #: Load the prompt's blocks up from lower tiers now; generate nothing.
    prefetch: bool = field(default=False, validator=_FLAG)
    #: OpenAI's ``prompt_cache_key``: the request's group (a conversation),
    #: for grouping and routing; at most 256 characters.
    cache_key: str | None = field(
        default=None,
        validator=_hint(lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= 256), "1 to 256 characters"),
    )

    def __attrs_post_init__(self) -> None:
        if self.pin and self.unpin:
            raise ValueError("kv_hints.unpin: pin and unpin in one request")
        if self.release and (self.pin or self.retain_s or self.prefetch):
            raise ValueError("kv_hints.release: the conversation ends, so no pin, retain_s or prefetch with it")


def _hints_fit(request: Request, attribute: Any, hints: KVHints | None) -> None:
    if hints is not None and not isinstance(hints, KVHints):
        raise TypeError(f"kv_hints = {hints!r}: a KVHints or None")
    if hints is not None and max(hints.pin, hints.unpin) > len(request.prompt_token_ids):
        name = "pin" if hints.pin else "unpin"
        raise ValueError(f"kv_hints.{name}: more tokens than the prompt's {len(request.prompt_token_ids)}")


@frozen(eq=False)
class Request:
    """One inference request as it arrives: the facts, never the progress."""

    request_id: str
    prompt_token_ids: array[int] = field(converter=as_token_array)
    #: Output length. In replay the true length from the trace; in a real
    #: engine the request's ``max_tokens``.
    output_tokens: int
    arrival_s: float = 0.0
    tenant: str = "default"
    priority: int = 0
    session_id: str | None = None
    #: Generated token ids when the workload knows them (the built-in generator
    #: does), so that a finished request's output can be cached like a real
    #: engine caches it. ``None`` when unknown (Mooncake and Azure traces).
    output_token_ids: array[int] | None = field(default=None, converter=as_token_array)
    #: As vLLM's ``cache_salt``: requests share cached blocks only with
    #: requests of the same salt (e.g. per user, against timing attacks).
    cache_salt: str | None = None
    #: The text of the request's new input where the workload or engine has
    #: it (for a chat turn, the user's message; the history is in the token
    #: ids). Text-based lifetime predictors read it; ``None`` when unknown.
    prompt_text: str | None = None
    #: When the first token is due (the request's TTFT SLO), in the same
    #: clock as ``arrival_s``; ``None`` when it has no deadline. SLO-aware
    #: policies read it; the report counts the deadlines met.
    deadline_s: float | None = None
    #: What the client knows about this request's KV (:class:`KVHints`):
    #: retention, pins, the conversation's end, prefetch, its group.
    kv_hints: KVHints | None = field(default=None, validator=_hints_fit)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@define(eq=False)
class SequenceState:
    """A request in flight. The runtime writes ``prediction``, ``status``,
    the block lists, ``cached_tokens_hint``, ``num_cached_tokens`` and
    ``num_preemptions``, and sets ``num_computed_tokens`` at admission and
    preemption; the engine advances
    ``num_computed_tokens`` and ``num_output_tokens`` as it computes and
    stamps ``first_token_s`` and ``finish_s``. An engine that keeps its own
    blocks and queues (vLLM, LMDeploy) mirrors ``status``,
    ``num_computed_tokens`` and ``num_preemptions`` from its own sequence
    before passes read them. Passes only read it."""

    request: Request
    prediction: LifetimePrediction | None = None
    status: RequestStatus = RequestStatus.WAITING
    #: Physical block ids, in token order: the prefix-cache hit first.
    block_ids: list[int] = field(factory=list)
    #: Blocks this request owns outright (allocated, not adopted by the cache).
    private_block_ids: set[int] = field(factory=set)
    #: Tokens whose KV is in ``block_ids`` (prompt, then generated).
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    #: Cached tokens found by the lookup at arrival (or at the last requeue);
    #: a hint for scheduling passes, the admission match is authoritative.
    cached_tokens_hint: int = 0
    #: Prompt tokens found in KV at its first admission (the device cache,
    #: then the host tier): the admission's count, not the hint.
    num_cached_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    num_preemptions: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what must be in KV to decode next."""
        return self.request.num_prompt_tokens + self.num_output_tokens

    @property
    def in_prefill(self) -> bool:
        """True until the prompt (and, after a preemption, the recomputed
        output) is in KV; a decode step has exactly one token to compute."""
        return self.num_output_tokens == 0 or self.num_computed_tokens < self.num_tokens - 1


#: The chain key of "no parent": a first block's key chains from it.
ROOT_KEY = 0


def chain_key(parent_key: int, page: bytes) -> int:
    """The content key of a block: a stable 64-bit hash of its parent's key
    and its own tokens, so equal keys mean equal prefixes (vLLM's chained
    block hashing, with SHA-256 as vLLM's default; the CPU's SHA extensions
    make it the fastest of hashlib's on a 4 KB page). Stable across
    processes, unlike ``hash``."""
    digest = hashlib.sha256(parent_key.to_bytes(8, "little"))
    digest.update(page)
    return int.from_bytes(digest.digest()[:8], "little")


@frozen(slots=True)
class CachedBlock:
    """A block held by the prefix cache, as observation hooks report it."""

    block_id: int
    #: Position in its prefix chain: 0 for the first block of a prompt.
    depth: int
    #: Block id of the chain's previous block; ``None`` at depth 0.
    parent_id: int | None
    #: Content key (:func:`chain_key`): equal for equal token prefixes.
    key: int = ROOT_KEY
    namespace: str = ""
    #: The tenant whose isolated namespace holds the block; ``None`` where
    #: tenants share the cache (the block belongs to all of them).
    tenant: str | None = None


@frozen
class PrefixMatch:
    """The longest cached prefix of a request, block-aligned."""

    blocks: tuple[CachedBlock, ...] = ()

    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple(b.block_id for b in self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


EMPTY_MATCH = PrefixMatch()


@frozen
class PrefixInsert:
    """What ``sagellm_insert_prefix`` did with the blocks it was given."""

    #: Blocks the cache adopted (now shared, locked for the request).
    adopted: tuple[CachedBlock, ...] = ()
    #: ``(given block id, cached block)`` for pages whose content the cache
    #: already held under another block: the request switches to the cached
    #: block (its KV is the same) and the runtime frees the given one, as
    #: SGLang does, so no page is held twice.
    replaced: tuple[tuple[int, CachedBlock], ...] = ()
    #: Cached blocks that were evictable and are now locked for the request
    #: (its path runs through them); observed as touched.
    locked: tuple[CachedBlock, ...] = ()


@frozen
class BlockAllocation:
    block_ids: tuple[int, ...]


@frozen
class PoolUsage:
    num_blocks: int
    num_free_blocks: int
    #: Runs of consecutive free block ids (1 when the free space is one run).
    num_free_runs: int = 1

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def external_fragmentation(self) -> float:
        """0 when the free blocks form one run, 1 when no two are adjacent;
        matters to engines and transports that move runs of blocks."""
        if self.num_free_blocks <= 1:
            return 0.0
        return (self.num_free_runs - 1) / (self.num_free_blocks - 1)


class EvictionCandidates(Protocol):
    """The prefix cache's evictable blocks (unreferenced), as the runtime hands
    them to the victim-selection hook. Membership and size are O(1)."""

    def __contains__(self, block_id: object) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[int]: ...


@frozen
class EvictionDecision:
    #: Victims in eviction order. Each must be an evictable candidate. Evicting
    #: a block also drops its cached descendants, which are useless without it.
    victim_ids: tuple[int, ...]


@frozen
class PreemptionDecision:
    #: The running request to preempt (recompute) to free its blocks.
    request_id: str


@frozen
class LifetimePrediction(PredictedLengths):
    """Predicted output length of a request: the median, an 80% interval
    (10th to 90th percentile) and a confidence."""

    output_tokens: float
    low_tokens: float
    high_tokens: float
    #: 0..1; consumers may ignore predictions below their own threshold.
    confidence: float
    predictor: str = ""
    #: The predicted length's quantiles at :data:`QUANTILE_LEVELS`,
    #: non-decreasing, or ``()`` when the predictor gives only the interval.
    quantiles: tuple[float, ...] = field(default=(), converter=tuple)


@define
class ScheduleIR:
    """What one scheduling step starts from. Passes run in the configured order
    and refine it in place: they reorder ``waiting`` (admission order) and
    ``running`` (budget order; the tail is preempted first by the default
    preemption rule), may lower ``token_budget`` or ``max_num_seqs``, and may
    cap a request's tokens in the step in ``chunk_limits`` (request id ->
    at most that many; 0 holds a waiting request back, a running one gets
    at least 1). The step engines (replay, torch) honour the caps; the vLLM
    and LMDeploy schedulers size their own chunks."""

    now_s: float
    waiting: list[SequenceState]
    running: list[SequenceState]
    token_budget: int
    max_num_seqs: int
    chunk_limits: dict[str, int] = field(factory=dict)


class Admission(enum.Enum):
    ADMIT = "admit"
    #: Not now: it keeps its place in the queue, the next one is asked.
    DEFER = "defer"
    #: Never: it ends rejected, counted under the decision's reason.
    REJECT = "reject"


@frozen
class AdmissionDecision:
    """What ``sagellm_admit_request`` decided for a waiting request."""

    verdict: Admission
    #: Why, in a few words: a rejection is counted under it in the report.
    reason: str = "rejected at admission"


@frozen(eq=False)
class TenantLedger:
    """Per tenant, what its admitted requests hold now, kept by the runtime
    (of the blocks it owns) and read by plugins: live read-only views."""

    #: Tenant -> blocks in its admitted requests' block tables (a cached
    #: block counts once for each request that holds it).
    blocks: Mapping[str, int]
    #: Tenant -> its admitted requests (running: not finished or preempted).
    requests: Mapping[str, int]


@frozen
class TransferPlan:
    """Move the KV of some blocks between tiers (``device``, ``host``, a
    remote peer's name). ``src_block_ids[i]`` goes to the i-th destination
    slot chosen by the transport."""

    src_tier: str
    dst_tier: str
    src_block_ids: tuple[int, ...]
    block_size: int
    #: Destination blocks, when the caller owns them (a load into blocks it
    #: allocated); empty lets the transport pick slots in a tier it manages.
    dst_block_ids: tuple[int, ...] = ()
    #: Content keys of the blocks (chained, so equal key means equal prefix),
    #: letting a tier find a block again on a later load.
    block_keys: tuple[Hashable, ...] = ()


@frozen
class TransferResult:
    ok: bool
    num_blocks: int
    num_bytes: int
    seconds: float
    dst_block_ids: tuple[int, ...] = ()
    error: str | None = None


@frozen(eq=False)
class KVCaches:
    """The real KV memory of an engine that has one (the torch engine), told
    to plugins once before the first request so that KV stores can move
    blocks' bytes. ``tensor`` is array-like (a ``torch.Tensor``) whose
    dimension ``block_dim`` indexes the pool's block ids: block ``b`` of
    every layer is ``tensor.select(block_dim, b)``."""

    tensor: Any
    block_dim: int
    #: ``copy_blocks(src, src_ids, dst, dst_ids)``: how the engine's device
    #: copies blocks between this tensor and a host tensor of the same
    #: per-block shape (on its copy stream, waiting for completion). A
    #: transport uses it, so it needs no knowledge of the device.
    copy_blocks: Callable[[Any, Sequence[int], Any, Sequence[int]], None] | None = None
    #: Which model's KV this is (its name and the identity of its weights):
    #: part of :attr:`fingerprint`, so that a block of another model is
    #: never taken for this one's.
    model: str = ""

    @property
    def fingerprint(self) -> str:
        """The KV layout's identity (32 hex digits): the model, the dtype and
        the shape of one block (the block size, layers, heads, head size) in
        the layout of ``block_dim``. A store that outlives the process (a
        disk, a shared store) keys blocks by it and the content key, so
        another process or a restarted one finds the same blocks, and never
        a block of another model or layout."""
        shape = list(self.tensor.shape)
        del shape[self.block_dim]
        layout = f"{self.model}|{self.tensor.dtype}|{shape}|{self.block_dim}"
        return hashlib.sha256(layout.encode()).hexdigest()[:32]

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[self.block_dim])

    @property
    def bytes_per_block(self) -> int:
        return int(self.tensor.nbytes // self.num_blocks)

    def copy(self, src: Any, src_ids: Sequence[int], dst: Any, dst_ids: Sequence[int]) -> None:
        """Copy blocks between this KV (or a host tensor of its per-block
        layout) and another: the engine's ``copy_blocks``, else indexing
        along ``block_dim`` (numpy's or torch's)."""
        if self.copy_blocks is not None:
            self.copy_blocks(src, src_ids, dst, dst_ids)
            return
        lead = (slice(None),) * self.block_dim
        dst[(*lead, list(dst_ids))] = src[(*lead, list(src_ids))]


def block_checksum(data: Any) -> int:
    """The checksum a store records for a block's bytes when it is put and
    the runtime checks before the block re-enters the device pool (CRC-32:
    zlib's, at memory speed; it catches torn and flipped bytes, not an
    adversary). ``data``: a C-contiguous buffer, e.g. a numpy row."""
    return zlib.crc32(data)


@frozen(eq=False)
class StoredBlocks:
    """Blocks a store read back for the runtime, in host memory, not yet in
    the device pool: the runtime checks each block's bytes against the
    checksum recorded when it was put and copies in the leading run that
    passes (``KVCaches.copy_blocks(source, row_ids, ...)``)."""

    #: Host memory holding the blocks in the device tensor's layout (the
    #: block dimension is ``KVCaches.block_dim``).
    source: Any
    #: The blocks' rows in ``source``, in the order asked.
    row_ids: tuple[int, ...]
    #: Each block's bytes (a C-contiguous buffer each), what is checksummed.
    views: tuple[Any, ...]
    #: :func:`block_checksum` of each block, recorded when it was put.
    checksums: tuple[int, ...]


def completed(value: Any) -> Future[Any]:
    """A future already holding ``value``: a store's answer to a request it
    served at once (a copy that does not overlap anything)."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class LoadCosts(Protocol):
    """What loading a store's blocks into the pool costs against computing
    them, as the engine knows it (replay: modelled and ``simulated``, loads
    take this time; a real engine: measured): load-or-recompute asks it."""

    simulated: bool

    def load_s(self, tier: str, num_blocks: int) -> float:
        """Seconds to load ``num_blocks`` blocks from the store ``tier``."""

    def recompute_s(self, num_tokens: int, num_cached_tokens: int) -> float:
        """Seconds to compute ``num_tokens`` prompt tokens after ``num_cached_tokens``."""

    def loaded(self, tier: str, num_blocks: int, seconds: float) -> None:
        """``num_blocks`` from ``tier`` were read, checked and copied into the pool in ``seconds`` (measured)."""


class KVStore(Protocol):
    """A tier of KV blocks below the device pool (LMCache's storage backend):
    host memory, a local disk, a store shared by instances. Blocks are
    known by content key (:attr:`CachedBlock.key`); the store reads device
    blocks from the ``KVCaches`` announced by ``sagellm_kv_caches_allocated``
    and keeps them as it likes. Answers that take time are futures, so a
    copy can overlap compute. Served by ``sagellm.kv_stores`` plugins,
    ordered by ``[kv_stores] tiers``, the fastest first."""

    def contains(self, keys: Sequence[int]) -> int:
        """How many of ``keys``, from the first, this store holds now."""

    def put(self, blocks: Sequence[CachedBlock]) -> Future[int]:
        """Copy the device blocks ``blocks`` (their ``block_id``s) into the
        store under their keys, or decline some (the store's admission);
        the device blocks may be reused once this returns. Resolves to the
        blocks written."""

    def get(self, keys: Sequence[int]) -> Future[StoredBlocks]:
        """Read the blocks of ``keys`` (all held, as ``contains`` said) into
        host memory, with the checksums recorded at their put."""

    def prefetch(self, keys: Sequence[int]) -> Future[int]:
        """Start moving the leading held ``keys`` to where ``get`` reads
        fastest; resolves to how many are ready."""

    def pin(self, keys: Sequence[int]) -> None:
        """Keep ``keys`` from being evicted until :meth:`unpin`."""

    def unpin(self, keys: Sequence[int]) -> None:
        """Let ``keys`` be evicted again (one unpin for each pin)."""

    def remove(self, keys: Sequence[int]) -> None:
        """Drop ``keys`` (a block that failed its check is never served again)."""

    def stats(self) -> Mapping[str, int]:
        """The store's own counts (what it holds, recovered, dropped...),
        shown in the report beside what the runtime counted of it."""


@frozen
class RequestOutcome:
    """What the runtime observed of a finished request."""

    request: Request
    num_output_tokens: int
    #: Prompt tokens found in KV at its first admission (device cache and host tier).
    num_cached_tokens: int
    arrival_s: float
    first_token_s: float
    finish_s: float
    num_preemptions: int
    prediction: LifetimePrediction | None

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


@frozen
class InstanceLoad:
    """One instance of a cluster as the routing decision sees it."""

    instance_id: str
    #: ``colocated``, ``prefill`` or ``decode``.
    role: str
    #: Prompt tokens queued there to prefill (waiting, and the rest of those mid-prefill).
    prefill_tokens: int
    #: Requests decoding there, and the tokens in their KV (its decode load).
    decode_requests: int
    decode_tokens: int
    #: This prompt's leading blocks in its device cache, then the next ones
    #: in its lower tiers (loadable instead of computed); both 0 while the
    #: router's index is degraded.
    cached_blocks: int = 0
    lower_tier_blocks: int = 0


@frozen
class RouteDecision:
    """Where a request goes: the instance that computes its prompt, and
    (with separate decode instances) the one its KV goes to."""

    instance_id: str
    decode_instance_id: str | None = None
