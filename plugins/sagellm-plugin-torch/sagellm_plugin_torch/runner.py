"""Running the model's own layers over paged KV.

The forward is thin on purpose: the engine calls the model's embedding, its
decoder layers, its final norm and its head, passing rotary positions from
the model's own rotary module. Only attention differs from transformers'
forward, and it is swapped in through transformers' attention-function
registry (``AttentionInterface``): the model's attention module projects Q,
K and V, applies its rotary embedding (and Qwen3's QK norms, Qwen2's biases),
then calls :func:`paged_attention_forward`, which writes K and V into the
step's slots and attends over each sequence's blocks through the device
seam. So the weights and numerics are the model's own, and the only KV state
is the block table the runtime decided.

A step's inputs are shaped for an accelerator (:class:`StepInputs`): the
engine writes each scheduled chunk into preallocated host arrays (pinned on
a GPU), which reach the device in one copy; block tables live in a
persistent per-request table (:class:`BlockTables`) of which only the rows
that changed are copied; slot mappings are computed on the device from it.
Nothing is allocated per step on the device. On a device that supports them
(``TorchDevice.graphs``), steps in which every sequence decodes one token
replay a CUDA graph captured for the next larger batch size, as do short
steps of a few sequences (:class:`StepGraphs`): one launch for the whole
model.

A step packed while the one before it runs (the engine's
``async_scheduling``) does not know its decodes' input tokens on the host:
they are the ids the running step samples. :meth:`StepInputs.feed` names
them, and :meth:`StepInputs.sync` copies them into the step's token ids on
the device after the host's inputs arrive, before anything reads them.
Such a step may be launched before the running step's tokens are collected,
its copies queued behind that step on the device: so the host's staging
(the step's inputs, the block tables' changed entries) is two buffers used
in turn, and a buffer is written again only once the copy that read it is
done.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from .decoder import FusedDecoder
from .devices import BLOCK_DIM, AttentionBatch, TorchDevice

ATTENTION_NAME = "sagellm_paged"


@attrs.frozen
class StepContext:
    """What every layer's attention needs for one step."""

    device: TorchDevice
    kv: torch.Tensor
    batch: AttentionBatch


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sagellm_step: StepContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' registry. ``query`` is
    ``[1, heads, tokens, head_dim]`` and ``key``/``value`` ``[1, kv_heads,
    tokens, head_dim]``: the step's tokens of every sequence, flattened."""
    if sagellm_step is None:
        raise RuntimeError("sagellm_paged attention runs inside the torch engine's forward only")
    step = sagellm_step
    layer = module.layer_idx
    q = query[0].transpose(0, 1)
    step.device.write_kv(step.kv, layer, key[0].transpose(0, 1), value[0].transpose(0, 1), step.batch)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = step.device.paged_attention(q.contiguous(), step.kv, layer, step.batch, scale)
    return out[None], None  # [1, tokens, heads, head_dim], as transformers' sdpa returns


_registered = False


def register_attention() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        _registered = True


@attrs.frozen
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> KVShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return (
            self.num_layers
            * 2
            * block_size
            * self.kv_heads
            * self.head_dim
            * torch.empty((), dtype=dtype).element_size()
        )


def _host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


class BlockTables:
    """Every scheduled request's block ids as a row of one table on the
    device. A request keeps its row while it is scheduled step after step;
    only the entries that changed since the last step (a new block at the
    end as a sequence grows, a block replaced by a cached copy, a new list
    after preemption) travel to the device, as (row, column, block) triples
    in one copy and one scatter. The table is as wide as the longest
    sequence the engine admits (``max_model_len``)."""

    #: Changed entries staged per step; a step that changes more copies whole rows.
    STAGE = 1 << 16

    def __init__(self, num_rows: int, width: int, device: torch.device, pin: bool, event: Any = None):
        self.width = width
        #: Makes an event (``TorchDevice.event``) to record after a copy from the host's staging.
        self._event = event
        self.on_host = device.type == "cpu"
        self.device = torch.zeros((num_rows, width), dtype=torch.int32, device=device)
        self._host_rows = None if self.on_host else _host_tensor((num_rows, width), torch.int32, pin)
        # Two staging buffers used in turn, each with the event of the copy
        # that last read it; and the event of a copy of whole rows, after
        # which the host writes rows again.
        self._stages = [] if self.on_host else [_host_tensor((self.STAGE, 3), torch.int32, pin) for _ in range(2)]
        self._staged_events: list[Any] = [None, None]
        self._stage_turn = 0
        self._rows_copied: Any = None
        self._stage_device = None if self.on_host else torch.zeros((self.STAGE, 3), dtype=torch.int32, device=device)
        self._table = (self.device if self.on_host else self._host_rows).numpy()
        self._row_of: dict[str, int] = {}
        #: Per row: the request it holds, the block ids written, the step it was last used.
        self._owner: list[str | None] = [None] * num_rows
        self._written: list[list[int]] = [[] for _ in range(num_rows)]
        self._used: list[int] = [-1] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        #: (row, first column) of the entries written since the last sync.
        self._changed: list[tuple[int, int, int]] = []
        self._step = 0

    def begin_step(self) -> None:
        self._step += 1
        if self._rows_copied is not None:  # a copy of whole rows reads the host table: it is done first
            self._rows_copied.synchronize()
            self._rows_copied = None

    def row(self, request_id: str, block_ids: list[int]) -> int:
        """The row holding ``request_id``'s ``block_ids``, written where they changed."""
        r = self._row_of.get(request_id)
        if r is None:
            r = self._take()
            self._row_of[request_id] = r
            self._owner[r] = request_id
            self._written[r] = []
        self._used[r] = self._step
        written = self._written[r]
        n, k = len(block_ids), len(written)
        if n == k and block_ids == written:
            return r  # as most steps find it: nothing new
        if n > self.width:
            raise RuntimeError(f"request {request_id} holds {n} blocks; the block table has room for {self.width}")
        first = k if n > k and block_ids[:k] == written else 0  # grown at the end, or rewritten
        self._table[r, first:n] = block_ids[first:]
        self._written[r] = list(block_ids)
        self._changed.append((r, first, n))
        return r

    def rows(self, request_ids: list[str], block_ids: list[list[int]]) -> list[int]:
        """:meth:`row` of each request in turn, in one call: a decode step's
        rows, most of them unchanged since the last step."""
        row_of, written, used, step = self._row_of.get, self._written, self._used, self._step
        rows = []
        for request_id, blocks in zip(request_ids, block_ids):
            r = row_of(request_id)
            if r is None or blocks != written[r]:
                r = self.row(request_id, blocks)
            else:
                used[r] = step
            rows.append(r)
        return rows

    def release(self, request_id: str) -> None:
        r = self._row_of.pop(request_id, None)
        if r is not None:
            self._owner[r] = None
            self._written[r] = []
            self._free.append(r)

    def _take(self) -> int:
        if not self._free:
            # Rows of requests that left without being released (preempted
            # and waiting, say) go back once they were not used this step.
            for r, owner in enumerate(self._owner):
                if owner is not None and self._used[r] < self._step:
                    self.release(owner)
        if not self._free:
            raise RuntimeError("more requests scheduled in one step than the block table has rows")
        return self._free.pop()

    def _recorded(self) -> Any:
        if self._event is None:
            return None
        event = self._event()
        event.record()
        return event

    def sync(self) -> None:
        """Bring the device table up to date with the rows written since the last sync."""
        changed, self._changed = self._changed, []
        if self.on_host or not changed:
            return
        count = sum(n - first for _, first, n in changed)
        if count > self.STAGE:
            lo, hi = min(r for r, _, _ in changed), max(r for r, _, _ in changed) + 1
            self.device[lo:hi].copy_(self._host_rows[lo:hi], non_blocking=True)
            self._rows_copied = self._recorded()
            return
        turn = self._stage_turn
        self._stage_turn = 1 - turn
        if self._staged_events[turn] is not None:  # the copy that read this buffer two syncs ago
            self._staged_events[turn].synchronize()
        host_stage = self._stages[turn]
        stage, at = host_stage.numpy(), 0
        for r, first, n in changed:
            stage[at : at + n - first, 0] = r
            stage[at : at + n - first, 1] = np.arange(first, n, dtype=np.int32)
            stage[at : at + n - first, 2] = self._table[r, first:n]
            at += n - first
        staged = self._stage_device[:at]
        staged.copy_(host_stage[:at], non_blocking=True)
        self._staged_events[turn] = self._recorded()
        self.device.index_put_((staged[:, 0].long(), staged[:, 1].long()), staged[:, 2])


class StepInputs:
    """One step's inputs, written by the engine chunk by chunk into host
    arrays that reach the device in one copy. int32 throughout (token ids,
    positions and slots fit); slots are computed on the device."""

    def __init__(self, max_tokens: int, max_seqs: int, device: torch.device, pin: bool, event: Any = None):
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        # One packed buffer: per token its id, position and sequence; per
        # sequence its block-table row, length, query start (one more) and
        # the flat index of the row it samples; per fed token its index and
        # the row of the running step's ids it reads.
        lengths = (max_tokens, max_tokens, max_tokens, max_seqs, max_seqs, max_seqs + 1, max_seqs, max_seqs, max_seqs)
        on_host = device.type == "cpu"
        # On the CPU the step reads the host arrays themselves; elsewhere two
        # packed host buffers take turns (a step launched behind a running
        # one copies its buffer only once that one is done), each with the
        # event of the copy that last read it.
        self._buffers = [_host_tensor((sum(lengths),), torch.int32, pin) for _ in range(1 if on_host else 2)]
        self._copied: list[Any] = [None] * len(self._buffers)
        self._event = event
        self._turn = 0
        self.device_buffer = self._buffers[0] if on_host else torch.zeros_like(self._buffers[0], device=device)
        self._views: list[tuple[np.ndarray, ...]] = []
        for buffer in self._buffers:
            views, at = [], 0
            for length in lengths:
                views.append(buffer[at : at + length].numpy())
                at += length
            self._views.append(tuple(views))
        dev, at = [], 0
        for length in lengths:
            dev.append(self.device_buffer[at : at + length])
            at += length
        (
            self.token_ids,
            self.positions,
            self.seq_of_token,
            self.rows,
            self.seq_lens,
            self.query_start,
            self.sample_rows,
            self.fed_at,
            self.fed_row,
        ) = dev
        self._arange = np.arange(max(max_tokens, max_seqs + 1), dtype=np.int32)
        self._use(0)
        self.reset()

    def _use(self, turn: int) -> None:
        """Write the next step into host buffer ``turn``, once the copy
        that last read it is done."""
        self._turn = turn
        self.host = self._buffers[turn]
        (
            self._tokens,
            self._positions,
            self._seq_of_token,
            self._rows,
            self._seq_lens,
            self._query_start,
            self._sample_rows,
            self._fed_at,
            self._fed_row,
        ) = self._views[turn]
        copied = self._copied[turn]
        if copied is not None:
            copied.synchronize()
            self._copied[turn] = None

    def reset(self) -> None:
        self.num_tokens = 0
        self.num_seqs = 0
        self.num_samples = 0
        self.max_query_len = 0
        self.padded = False
        #: The same, as host lists: for devices whose kernels take them (the reference, Ascend's).
        self.query_lens: list[int] = []
        self.seq_len_list: list[int] = []
        self.query_start_list: list[int] = []
        self._query_start[0] = 0
        #: The running step's sampled ids, and how many tokens read them
        #: (:meth:`feed`); ``_fed_in_order``: the first ``num_fed`` tokens read rows 0..num_fed - 1.
        self._fed_from: torch.Tensor | None = None
        self.num_fed = 0
        self._fed_in_order = False

    def add(self, tokens: list[int], start: int, n: int, row: int, sample: bool) -> None:
        """Sequence ``tokens[start : start + n]`` is scheduled (its KV up to
        ``start`` is cached or computed), its blocks in table row ``row``;
        ``sample``: its next token is sampled after this step."""
        t, i = self.num_tokens, self.num_seqs
        if t + n > self.max_tokens or i >= self.max_seqs:
            raise RuntimeError(
                f"a step of more than {self.max_tokens} tokens or {self.max_seqs} sequences"
                " (max_num_batched_tokens / max_num_seqs)"
            )
        if n == 1:
            self._tokens[t] = tokens[start]
            self._positions[t] = start
            self._seq_of_token[t] = i
        else:
            self._tokens[t : t + n] = tokens[start : start + n]
            self._positions[t : t + n] = np.arange(start, start + n, dtype=np.int32)
            self._seq_of_token[t : t + n] = i
        self._rows[i] = row
        self._seq_lens[i] = start + n
        self.num_tokens = t + n
        self._query_start[i + 1] = t + n
        self.num_seqs = i + 1
        self.query_start_list.append(t)
        self.query_lens.append(n)
        self.seq_len_list.append(start + n)
        if n > self.max_query_len:
            self.max_query_len = n
        if sample:
            self._sample_rows[self.num_samples] = t + n - 1
            self.num_samples += 1

    def add_decodes(self, token_ids: list[int], positions: list[int], rows: list[int]) -> None:
        """A step of decodes only, written at once: sequence i reads its
        token ``token_ids[i]`` at ``positions[i]`` (its context before it),
        its blocks in table row ``rows[i]``, and samples its next token."""
        n = len(token_ids)
        if n > self.max_seqs or self.num_seqs:
            raise RuntimeError(f"{n} decodes in a step of at most {self.max_seqs} sequences, or after other chunks")
        self._tokens[:n] = token_ids
        self._positions[:n] = positions
        self._seq_lens[:n] = self._positions[:n] + 1
        self._seq_of_token[:n] = self._arange[:n]
        self._rows[:n] = rows
        self._query_start[: n + 1] = self._arange[: n + 1]
        self._sample_rows[:n] = self._arange[:n]
        self.num_tokens = self.num_seqs = self.num_samples = n
        self.max_query_len = 1
        self.query_lens = [1] * n
        self.seq_len_list = [p + 1 for p in positions]
        self.query_start_list = list(range(n))

    def feed(self, ids: torch.Tensor, count: int, at: list[int] | None = None, rows: list[int] | None = None) -> None:
        """Token ``at[j]`` of the step is ``ids[rows[j]]`` (``ids``: the
        running step's sampled ids, on the device), for ``count`` tokens;
        without ``at`` and ``rows``, tokens 0..count - 1 are ids 0..count - 1.
        Written on the device by :meth:`sync`."""
        if count > self.max_seqs:
            raise RuntimeError(f"{count} fed tokens in a step of at most {self.max_seqs} sequences")
        self._fed_from, self.num_fed = ids, count
        self._fed_in_order = at is None
        if at is not None and rows is not None:
            self._fed_at[:count] = at
            self._fed_row[:count] = rows

    def pad_to(self, num_tokens: int, num_seqs: int) -> None:
        """Padding for a captured graph of ``num_tokens`` tokens and
        ``num_seqs`` sequences: padding tokens have position -1 (their KV
        is written nowhere) and belong to no sequence's queries; padding
        sequences have no context and no queries (attention reads nothing
        for them) and sample a padding row."""
        t, i = self.num_tokens, self.num_seqs
        if t < num_tokens:
            self._tokens[t:num_tokens] = 0
            self._positions[t:num_tokens] = -1
            self._seq_of_token[t:num_tokens] = 0
        if i < num_seqs:
            self._rows[i:num_seqs] = 0
            self._seq_lens[i:num_seqs] = 0
            self._query_start[i + 1 : num_seqs + 1] = t
        if self.num_samples < num_seqs:
            self._sample_rows[self.num_samples : num_seqs] = max(t - 1, 0)
        self.padded = True

    def sync(self) -> None:
        if self.device_buffer is not self.host:
            self.device_buffer.copy_(self.host, non_blocking=True)
            turn = self._turn
            if self._event is not None:
                self._copied[turn] = copied = self._event()
                copied.record()
            self._use(1 - turn)
        k, ids = self.num_fed, self._fed_from
        if ids is None or not k:
            return
        if self._fed_in_order:
            self.token_ids[:k].copy_(ids[:k])
        else:
            picked = ids.index_select(0, self.fed_row[:k].long()).to(self.token_ids.dtype)
            self.token_ids.index_copy_(0, self.fed_at[:k].long(), picked)


class ModelRunner:
    """One model on one device, with the KV tensor the pool's blocks index."""

    def __init__(
        self,
        model,
        device: TorchDevice,
        num_blocks: int,
        block_size: int,
        *,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
        graphs: bool = True,
    ):
        register_attention()
        self.model = model.to(device.torch_device)
        # The configs the attention modules read their implementation from
        # when they are called. The engine switches them to sagellm's paged
        # attention for its own forward only: the model object is shared
        # (``models.load`` caches it) and stays usable by transformers.
        self._attention_configs = list(
            {id(layer.self_attn.config): layer.self_attn.config for layer in model.model.layers}.values()
        )
        self.device = device
        self.block_size = block_size
        self.shape = KVShape.of(model.config)
        self.dtype = next(model.parameters()).dtype
        self.kv = device.allocate_kv(
            self.shape.num_layers, num_blocks, block_size, self.shape.kv_heads, self.shape.head_dim, self.dtype
        )
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        dev = device.torch_device
        pin = dev.type == "cuda"
        max_len = max_model_len or num_blocks * block_size
        self.max_seqs = max_num_seqs
        # A step holds every running sequence's decode token, or the token
        # budget of prefill chunks; graphs pad decodes up to a bucket.
        self.inputs = StepInputs(max(max_num_batched_tokens, max_num_seqs), max_num_seqs, dev, pin, device.event)
        self.tables = BlockTables(2 * max_num_seqs, -(-max_len // block_size), dev, pin, device.event)
        #: The runner's own decoder forward, where the device has fused ops
        #: and the model is of a family it knows; else the model's modules.
        self.decoder = FusedDecoder.of(self.model) if device.fused_layers else None
        self.graphs = StepGraphs(self) if graphs and device.graphs else None
        if self.graphs is not None:
            self._compile_attention()
            self.graphs.capture_all()

    def _compile_attention(self) -> None:
        """Launch the paged attention of a step of padding rows (no KV read
        or written) for every query-tile size a step can use, on the
        runner's own buffers: a device that compiles its kernels at their
        first launch (Triton: hundreds of milliseconds each) does it now, not
        on a request's time."""
        heads = self.model.config.get_text_config().num_attention_heads
        tokens = 1
        while tokens <= min(self.inputs.max_tokens, 512):
            inputs = self.begin_step()
            inputs.pad_to(tokens, 1)
            inputs.sync()
            batch = self._batch(inputs, tokens, 1, False, tokens)
            query = torch.zeros((tokens, heads, self.shape.head_dim), dtype=self.dtype, device=self.kv.device)
            self.device.paged_attention(query, self.kv, 0, batch, 1.0)
            tokens *= 2
        self.begin_step()

    @property
    def block_dim(self) -> int:
        return BLOCK_DIM

    def begin_step(self) -> StepInputs:
        self.inputs.reset()
        self.tables.begin_step()
        return self.inputs

    def release(self, request_id: str) -> None:
        """``request_id`` left the engine: its block-table row is free."""
        self.tables.release(request_id)

    def _batch(
        self, inputs: StepInputs, num_tokens: int, num_seqs: int, all_decode: bool, max_query_len: int
    ) -> AttentionBatch:
        """The step's attention layout on the device, from the synced buffers."""
        bs = self.block_size
        rows = inputs.rows[:num_seqs]
        # As wide as this step's longest sequence needs; a captured graph's
        # as wide as the table (its sequences' lengths change each replay).
        width = self.tables.width if inputs.padded else -(-max(inputs.seq_len_list) // bs)
        tables = self.tables.device[:, :width].index_select(0, rows)
        seq_of_token = inputs.seq_of_token[:num_tokens].long()
        positions = inputs.positions[:num_tokens]
        block = tables[seq_of_token, (positions // bs).long()]
        slots = block.long() * bs + (positions % bs).long()
        if inputs.padded:  # padding tokens write nowhere
            slots = torch.where(positions >= 0, slots, -1)
        return AttentionBatch(
            slot_mapping=slots,
            query_lens=tuple(inputs.query_lens),
            seq_lens=tuple(inputs.seq_len_list),
            block_tables=tables,
            block_size=bs,
            all_decode=all_decode,
            seq_lens_tensor=inputs.seq_lens[:num_seqs],
            query_start=tuple(inputs.query_start_list),
            query_start_loc=inputs.query_start[: num_seqs + 1],
            max_query_len=max_query_len,
        )

    def _hidden(self, token_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        inner = self.model.model
        ids = token_ids.long()[None]
        pos = positions.long()[None]
        hidden = inner.embed_tokens(ids)
        rotary = inner.rotary_emb(hidden, pos)
        for layer in inner.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=rotary, sagellm_step=step)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        return hidden[0]

    def _logits(self, state: tuple[torch.Tensor, torch.Tensor | None], rows: torch.Tensor) -> torch.Tensor:
        """float32 logits of the token rows ``rows`` of a forward's output."""
        hidden, residual = state
        if residual is None:
            normed = self.model.model.norm(hidden[rows])
        else:
            assert self.decoder is not None
            normed = self.decoder.final_norm(self.device, hidden[rows], residual[rows])
        return self.model.lm_head(normed).float()

    def _paged(self):
        runner = self

        class _Switch:
            def __enter__(self):
                self.saved = [config._attn_implementation for config in runner._attention_configs]
                for config in runner._attention_configs:
                    config._attn_implementation = ATTENTION_NAME

            def __exit__(self, *exc):
                for config, name in zip(runner._attention_configs, self.saved):
                    config._attn_implementation = name

        return _Switch()

    @torch.inference_mode()
    def execute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step the engine wrote into :meth:`begin_step`'s inputs;
        return ``(logits, greedy)``: the float32 logits of the sampled rows
        (in the order they were added) and their argmax, both on the device."""
        inputs = self.inputs
        if self.graphs is not None:
            graph = self.graphs.for_step(inputs)
            if graph is not None:
                return graph.replay(inputs)
        self.tables.sync()
        inputs.sync()
        num_tokens, num_seqs = inputs.num_tokens, inputs.num_seqs
        all_decode = inputs.max_query_len == 1
        batch = self._batch(inputs, num_tokens, num_seqs, all_decode, inputs.max_query_len)
        state = self._forward(inputs, num_tokens, batch)
        logits = self._logits(state, inputs.sample_rows[: inputs.num_samples].long())
        return logits, logits.argmax(dim=-1)

    def _forward(
        self, inputs: StepInputs, num_tokens: int, batch: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hidden, residual)`` of the step's tokens: the fused decoder's
        last MLP output and residual stream, or the model's modules' hidden
        states before the final norm and ``None``."""
        step = StepContext(self.device, self.kv, batch)
        token_ids, positions = inputs.token_ids[:num_tokens], inputs.positions[:num_tokens]
        if self.decoder is not None:
            return self.decoder.hidden(token_ids, positions, step)
        with self._paged():
            return self._hidden(token_ids, positions, step), None


class _CapturedStep:
    """One CUDA graph: a step of ``num_tokens`` tokens of ``num_seqs``
    sequences (decodes only when ``all_decode``), reading the runner's static
    input buffers, writing static logits and argmax for ``num_seqs`` rows.
    Captured from padding rows (:meth:`StepGraphs.capture_all`): the
    warm-up runs and the capture write no KV."""

    def __init__(self, runner: ModelRunner, num_tokens: int, num_seqs: int, all_decode: bool, pool: Any):
        self.runner = runner
        self.num_tokens, self.num_seqs, self.all_decode = num_tokens, num_seqs, all_decode
        runner.inputs.pad_to(num_tokens, num_seqs)
        runner.inputs.sync()
        runner.tables.sync()
        stream = torch.cuda.Stream(runner.device.torch_device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # kernels compiled and tuned outside the capture
                self._body()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits, self.greedy = self._body()

    def _body(self) -> tuple[torch.Tensor, torch.Tensor]:
        runner, inputs = self.runner, self.runner.inputs
        # A varlen graph's queries are bounded by its tokens: the kernel reads each one's count.
        batch = runner._batch(
            inputs, self.num_tokens, self.num_seqs, self.all_decode, 1 if self.all_decode else self.num_tokens
        )
        state = runner._forward(inputs, self.num_tokens, batch)
        logits = runner._logits(state, inputs.sample_rows[: self.num_seqs].long())
        return logits, logits.argmax(dim=-1)

    def replay(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        inputs.pad_to(self.num_tokens, self.num_seqs)
        self.runner.tables.sync()
        inputs.sync()
        self.graph.replay()
        return self.logits[: inputs.num_samples], self.greedy[: inputs.num_samples]


class StepGraphs:
    """CUDA graphs of the runner's steps, all captured when the runner is
    built, into one memory pool: decodes of up to ``max_num_seqs`` sequences padded to a
    bucket (vLLM's ``cudagraph_capture_sizes``: 1, 2, 4, 8, then steps of 8
    to 256, then of 16), and short steps of a few sequences with prefill
    chunks (up to :attr:`VARLEN_TOKENS` tokens of :attr:`VARLEN_SEQS`
    sequences, padded to powers of two): a prefill over a cached prefix is
    such a step, and costs a launch per kernel without a graph."""

    VARLEN_TOKENS = 256
    VARLEN_SEQS = 8

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        sizes = [s for s in (1, 2, 4) if s < runner.max_seqs]
        sizes += list(range(8, min(runner.max_seqs, 256) + 1, 8)) + list(range(272, runner.max_seqs + 1, 16))
        if runner.max_seqs not in sizes:
            sizes.append(runner.max_seqs)
        self.decode_sizes = sorted(set(sizes))
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int, bool], _CapturedStep] = {}

    def buckets(self) -> list[tuple[int, int, bool]]:
        """Every graph's (tokens, sequences, decodes only), largest first."""
        keys = [(size, size, True) for size in self.decode_sizes]
        tokens = 16
        while tokens <= min(self.VARLEN_TOKENS, self.runner.inputs.max_tokens):
            seqs = 1
            while seqs <= min(self.VARLEN_SEQS, self.runner.max_seqs):
                keys.append((tokens, seqs, False))
                seqs *= 2
            tokens *= 2
        return sorted(keys, key=lambda key: (-key[0], -key[1]))

    def capture_all(self) -> None:
        """Capture every bucket now, from padding rows (which write no KV and
        read none), the largest first so the smaller reuse its memory: at its
        first use mid-serving a capture, and the compilation of its kernels,
        would cost that step's requests hundreds of milliseconds."""
        for key in self.buckets():
            self.runner.begin_step()
            self._graphs[key] = _CapturedStep(self.runner, *key, self._pool)
        self.runner.begin_step()

    def for_step(self, inputs: StepInputs) -> _CapturedStep | None:
        """The graph for this step's layout; ``None`` where no bucket fits
        (the step runs eagerly)."""
        n, t = inputs.num_seqs, inputs.num_tokens
        if inputs.max_query_len == 1 and inputs.num_samples == n:
            size = next((s for s in self.decode_sizes if s >= n), None)
            if size is None:
                return None
            key = (size, size, True)
        elif t <= self.VARLEN_TOKENS and n <= self.VARLEN_SEQS:
            key = (max(16, 1 << (t - 1).bit_length()), 1 << (n - 1).bit_length(), False)
        else:
            return None
        return self._graphs.get(key)


def size_pool(
    model, device: TorchDevice, block_size: int, *, max_num_batched_tokens: int, max_num_seqs: int, utilization: float
) -> tuple[int, str]:
    """How many KV blocks fit in ``utilization`` of the device's memory
    beside the model (vLLM's ``gpu_memory_utilization``), and how that was
    worked out, in words. The model moves to the device; one eager step of
    the engine's largest size (``max_num_batched_tokens`` tokens of padding)
    runs over a KV tensor of one block, and its peak activation memory stays
    free twice: once for eager steps, once for the CUDA graphs' memory pool,
    whose largest step is no larger."""
    model.to(device.torch_device)
    peak = _step_peak(model, device, block_size, max_num_batched_tokens, max_num_seqs)
    if device.torch_device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's KV and activations go back to the device
    free, total = device.memory()
    used = total - free  # the weights, and whatever else holds the device
    per_block = KVShape.of(model.config).bytes_per_block(block_size, next(model.parameters()).dtype)
    room = int(total * utilization) - used - 2 * peak
    gib = 2**30
    how = (
        f"{utilization:.2f} of {total / gib:.2f} GiB, less {used / gib:.2f} GiB in use and twice a step's"
        f" {peak / gib:.2f} GiB of activations, in blocks of {per_block / 2**20:.2f} MiB"
    )
    return max(0, room // per_block), how


def _step_peak(model, device: TorchDevice, block_size: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Peak activation bytes of an eager step of ``max_num_batched_tokens``
    tokens of padding, on a runner of one block (gone when this returns)."""
    probe = ModelRunner(
        model,
        device,
        1,
        block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        graphs=False,
    )

    def step() -> None:
        probe.begin_step().pad_to(probe.inputs.max_tokens, 1)
        probe.execute()

    return device.peak_memory(step)
