"""The Triton kernels of the CUDA device against the plain-torch oracle
(``paged_attention_reference``, evaluated in float64), on the CPU through
Triton's interpreter and, unchanged, compiled on a GPU where one is present.

Every cache slot that holds no token of a sequence is NaN, and so is the
block the block tables are padded with: a kernel reading one KV row it should
not (past a sequence's length, a padding row's table) turns its output NaN.
Outputs are poisoned with NaN before each call, so a row left unwritten fails
too."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (the [triton] extra)", allow_module_level=True)

CUDA = torch.cuda.is_available()

# Triton decides between its interpreter and compiled kernels when a function
# is decorated with ``@triton.jit``, from TRITON_INTERPRET, and its own
# library functions (``tl.sum``, ``tl.max``, ``tl.cdiv``...) are decorated
# when ``triton.language`` is first imported: the variable has to be set
# before Triton is imported at all, in this process. A subprocess per case
# would hide the cases from pytest's parametrisation and cost an import of
# torch each. So on a machine without a GPU, where no compiled Triton kernel
# can run anyway, this module sets the variable for the import of Triton and
# of the kernels only, then restores it: other tests never see it. Where a GPU
# is present the kernels are compiled and the CPU cases skip (run them with
# ``TRITON_INTERPRET=1 pytest ...``); where Triton was imported before this
# module without the interpreter, they skip too. (The ``interpreter``
# fixture sets the variable again while this module's tests run.)
if not CUDA and "triton" not in sys.modules:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
        from sagellm_plugin_torch import triton_kernels
    finally:
        if _saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _saved

from sagellm_plugin_torch import triton_kernels  # noqa: E402
from sagellm_plugin_torch.devices import AttentionBatch, paged_attention_reference  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETED = isinstance(triton_kernels._decode_split_kernel, InterpretedFunction)
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not INTERPRETED, reason="the kernels are compiled: TRITON_INTERPRET was not set"),
    ),
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not CUDA or INTERPRETED, reason="needs a CUDA GPU, compiled kernels")
    ),
]
#: Relative error bound against the float64 oracle. 16-bit runs round the
#: softmax probabilities to the input dtype before the product with V (as
#: every flash-attention kernel does), and the output to it.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """While this module's tests run, TRITON_INTERPRET is set again: Triton
    imports parts of itself lazily at the first launch, and they check it.
    And Triton 3.6's interpreter turns a one-element array into a loop bound
    with ``int()``, which NumPy 2.4 refuses (fixed in Triton after 3.6): the
    conversion takes the element instead."""
    if not INTERPRETED:
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        patch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
        yield


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def dtypes_on(device: str) -> list[torch.dtype]:
    # The interpreter multiplies bfloat16 tiles as their raw 16-bit integers: bfloat16 is checked on a GPU only.
    return [torch.float32, torch.float16] if device == "cpu" else [torch.float32, torch.float16, torch.bfloat16]


# ------------------------------------------------------------------ layouts --


class Layout:
    """Paged caches holding ``seq_lens[i]`` random tokens per sequence in
    shuffled blocks; every other slot NaN. Tables are one column wider than
    the longest sequence needs, padded with a NaN block."""

    def __init__(self, seq_lens, block_size, kv_heads, head_dim, dtype, device, seed):
        self.generator = torch.Generator().manual_seed(seed)
        self.seq_lens, self.block_size, self.dtype, self.device = list(seq_lens), block_size, dtype, device
        blocks_of = [-(-n // block_size) for n in self.seq_lens]
        num_blocks = sum(blocks_of) + 2
        shape = (num_blocks, block_size, kv_heads, head_dim)
        k_cache = torch.full(shape, float("nan"))
        v_cache = torch.full(shape, float("nan"))
        order = torch.randperm(num_blocks, generator=self.generator).tolist()
        self.pad_block = order.pop()
        tables = torch.full((len(self.seq_lens), max(blocks_of, default=0) + 1), self.pad_block, dtype=torch.int32)
        for i, (n, count) in enumerate(zip(self.seq_lens, blocks_of)):
            ids = [order.pop() for _ in range(count)]
            tables[i, :count] = torch.tensor(ids, dtype=torch.int32)
            for t in range(n):
                block, offset = ids[t // block_size], t % block_size
                k_cache[block, offset] = self.randn(kv_heads, head_dim)
                v_cache[block, offset] = self.randn(kv_heads, head_dim)
        self.k_cache = k_cache.to(dtype).to(device)
        self.v_cache = v_cache.to(dtype).to(device)
        self.block_tables = tables.to(device)
        self.seq_lens_tensor = torch.tensor(self.seq_lens, dtype=torch.int32, device=device)

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator)

    def queries(self, tokens: int, heads: int) -> torch.Tensor:
        return self.randn(tokens, heads, self.k_cache.shape[-1]).to(self.dtype).to(self.device)

    def reference(self, query, starts, query_lens, scale) -> tuple[torch.Tensor, torch.Tensor]:
        """The oracle in float64 for the sequences that have queries
        (sequence ``i``'s are rows ``starts[i]:starts[i] + query_lens[i]`` of
        ``query``), and the rows of ``query`` it answers, in order."""
        seqs = [i for i, n in enumerate(query_lens) if n]
        rows = torch.cat([torch.arange(starts[i], starts[i] + query_lens[i]) for i in seqs])
        lens = [query_lens[i] for i in seqs]
        batch = AttentionBatch(
            slot_mapping=torch.empty(0, dtype=torch.long),
            query_lens=tuple(lens),
            seq_lens=tuple(self.seq_lens[i] for i in seqs),
            block_tables=self.block_tables[seqs],
            block_size=self.block_size,
            all_decode=False,
            seq_lens_tensor=self.seq_lens_tensor[seqs],
            query_start=tuple(sum(lens[:j]) for j in range(len(seqs))),
        )
        picked = query[rows.to(query.device)].double()
        expected = paged_attention_reference(picked, self.k_cache.double(), self.v_cache.double(), batch, scale)
        return expected, rows.to(query.device)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected).norm() / expected.norm()).item()


def run_decode(layout: Layout, heads: int, num_splits: int, workspace_seqs: int | None = None):
    num_seqs = len(layout.seq_lens)
    head_dim = layout.k_cache.shape[-1]
    query = layout.queries(num_seqs, heads)
    out = torch.full_like(query, float("nan"))
    workspace = triton_kernels.decode_workspace(workspace_seqs or num_seqs, heads, head_dim, num_splits, layout.device)
    scale = head_dim**-0.5
    triton_kernels.paged_decode_attention(
        query,
        layout.k_cache,
        layout.v_cache,
        layout.block_tables,
        layout.seq_lens_tensor,
        scale,
        out,
        num_splits=num_splits,
        workspace=workspace,
    )
    return query, out, scale


def check_decode(layout: Layout, query, out, scale) -> None:
    assert not out.isnan().any(), "a decode output element was left unwritten or read a slot it should not"
    query_lens = [1 if n else 0 for n in layout.seq_lens]
    padding = [i for i, n in enumerate(layout.seq_lens) if n == 0]
    assert (out[padding] == 0).all(), "a sequence of length 0 must get zeros"
    if any(query_lens):
        expected, rows = layout.reference(query, list(range(len(query_lens))), query_lens, scale)
        assert relative_error(out[rows], expected) < TOLERANCE[layout.dtype]


def run_prefill(layout: Layout, heads: int, query_lens: list[int]):
    tokens = sum(query_lens)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query = layout.queries(tokens, heads)
    out = torch.full_like(query, float("nan"))
    scale = layout.k_cache.shape[-1] ** -0.5
    triton_kernels.paged_prefill_attention(
        query,
        layout.k_cache,
        layout.v_cache,
        layout.block_tables,
        torch.tensor(starts, dtype=torch.int32, device=layout.device),
        layout.seq_lens_tensor,
        scale,
        out,
        max_query_len=max(query_lens),
    )
    assert not out.isnan().any(), "a prefill output element was left unwritten or read a slot it should not"
    expected, rows = layout.reference(query, starts, query_lens, scale)
    assert relative_error(out[rows], expected) < TOLERANCE[layout.dtype]


# ------------------------------------------------------------------ write_kv --


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("block_size", "kv_heads", "head_dim"), [(16, 8, 64), (32, 3, 80)])
def test_write_kv_scatters_both_caches_and_skips_padding(device, block_size, kv_heads, head_dim, slot_dtype):
    g = torch.Generator().manual_seed(block_size + head_dim)
    num_blocks, tokens = 6, 21
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(device)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(device)
    # The runner passes key/value as transposed views of [kv_heads, tokens, head_dim]: not contiguous.
    key = torch.randn(kv_heads, tokens, head_dim, generator=g).to(device).transpose(0, 1)
    value = torch.randn(kv_heads, tokens, head_dim, generator=g).to(device).transpose(0, 1)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[0, 5, 20]] = -1  # padding rows of a captured batch
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    written = slots >= 0
    flat = (-1, kv_heads, head_dim)
    expected_k.view(flat)[slots[written].to(device)] = key[written.to(device)]
    expected_v.view(flat)[slots[written].to(device)] = value[written.to(device)]

    triton_kernels.write_kv(key, value, k_cache, v_cache, slots.to(slot_dtype).to(device))
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


# ------------------------------------------------------------------- decode --

# (heads, kv_heads, head_dim, block_size, num_splits): group sizes 1, 3 and 4,
# head dims 64, 128 and 80, block sizes 16 and 32, 1, 2 and 8 splits.
DECODE_LAYOUTS = [
    (4, 4, 64, 16, 8),
    (9, 3, 64, 32, 2),
    (8, 2, 128, 16, 1),
    (8, 2, 128, 32, 8),
    (6, 2, 80, 16, 2),
    (32, 8, 64, 16, 2),
]
#: Lengths 1 and 0 (a padding row), one block exactly, several blocks, and
#: sequences with fewer tiles than 8 splits.
DECODE_SEQ_LENS = [1, 0, 37, 16, 70, 5]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "num_splits"), DECODE_LAYOUTS)
def test_decode_matches_reference(device, heads, kv_heads, head_dim, block_size, num_splits):
    for dtype in dtypes_on(device):
        layout = Layout(DECODE_SEQ_LENS, block_size, kv_heads, head_dim, dtype, device, seed=heads + head_dim)
        check_decode(layout, *run_decode(layout, heads, num_splits))


def test_decode_with_a_larger_shared_workspace(device):
    # One workspace serves every captured batch size: sized for more sequences than this decode has.
    layout = Layout([3, 40, 0], 16, 2, 64, torch.float32, device, seed=3)
    check_decode(layout, *run_decode(layout, 8, num_splits=4, workspace_seqs=64))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_decode_replays_in_a_cuda_graph():
    """Captured once, replayed over new queries and new lengths: no host
    synchronisation, no allocation and no branch on values during capture."""
    heads, kv_heads, head_dim, num_splits = 8, 2, 64, 4
    layout = Layout([50, 7, 33, 20], 16, kv_heads, head_dim, torch.float16, "cuda", seed=9)
    query = layout.queries(4, heads)
    out = torch.full_like(query, float("nan"))
    seq_lens = torch.tensor([1, 1, 1, 0], dtype=torch.int32, device="cuda")
    workspace = triton_kernels.decode_workspace(4, heads, head_dim, num_splits, "cuda")
    scale = head_dim**-0.5

    def step():
        triton_kernels.paged_decode_attention(
            query,
            layout.k_cache,
            layout.v_cache,
            layout.block_tables,
            seq_lens,
            scale,
            out,
            num_splits=num_splits,
            workspace=workspace,
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    query.copy_(layout.queries(4, heads))
    seq_lens.copy_(layout.seq_lens_tensor)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_decode(layout, query, out, scale)


# ------------------------------------------------------------------ prefill --

# (context per sequence, queries per sequence)
PREFILL_CASES = {
    "no-context": ([0, 0, 0], [9, 40, 1]),
    "context-not-block-aligned": ([21, 5, 50], [13, 30, 2]),
    "mixed-decode-and-prefill": ([40, 0, 6, 19, 1], [1, 35, 1, 7, 1]),
}
PREFILL_LAYOUTS = [(4, 4, 64, 16), (9, 3, 80, 32), (8, 2, 128, 16)]


@pytest.mark.parametrize("case", list(PREFILL_CASES))
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), PREFILL_LAYOUTS)
def test_prefill_matches_reference(device, case, heads, kv_heads, head_dim, block_size):
    contexts, query_lens = PREFILL_CASES[case]
    seq_lens = [c + n for c, n in zip(contexts, query_lens)]
    for dtype in dtypes_on(device):
        layout = Layout(seq_lens, block_size, kv_heads, head_dim, dtype, device, seed=len(case) + head_dim)
        run_prefill(layout, heads, query_lens)


# --------------------------------------------------------------- properties --

layouts = st.fixed_dictionaries(
    {
        "kv_heads": st.integers(1, 3),
        "group": st.integers(1, 5),
        "head_dim": st.sampled_from([16, 32, 48, 64]),
        # Any positive block size works: tiles gather rows through the table one token at a time.
        "block_size": st.sampled_from([1, 8, 12, 16, 32]),
        "seed": st.integers(0, 2**16),
    }
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts, seq_lens=st.lists(st.integers(0, 90), min_size=1, max_size=4), num_splits=st.integers(1, 9))
def test_decode_property(device, layout, seq_lens, num_splits):
    cache = Layout(
        seq_lens, layout["block_size"], layout["kv_heads"], layout["head_dim"], torch.float32, device, layout["seed"]
    )
    heads = layout["kv_heads"] * layout["group"]
    check_decode(cache, *run_decode(cache, heads, num_splits))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts, chunks=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 40)), min_size=1, max_size=4))
def test_prefill_property(device, layout, chunks):
    seq_lens = [context + n for context, n in chunks]
    cache = Layout(
        seq_lens, layout["block_size"], layout["kv_heads"], layout["head_dim"], torch.float32, device, layout["seed"]
    )
    run_prefill(cache, layout["kv_heads"] * layout["group"], [n for _, n in chunks])


@given(
    num_seqs=st.integers(1, 512),
    kv_heads=st.integers(1, 16),
    max_seq_len=st.integers(1, 1 << 17),
    num_sms=st.integers(1, 256),
)
def test_decode_num_splits_is_a_bounded_power_of_two(num_seqs, kv_heads, max_seq_len, num_sms):
    splits = triton_kernels.decode_num_splits(num_seqs, kv_heads, max_seq_len, num_sms)
    assert 1 <= splits <= 32 and splits & (splits - 1) == 0
    # No split shorter than 256 tokens unless there is just one.
    assert splits == 1 or max_seq_len > 256 * (splits // 2)
    # Once the sequences alone fill the device twice, splitting only adds a merge.
    if num_seqs * kv_heads >= 2 * num_sms:
        assert splits == 1


# --------------------------------------------------- the layer's glue ops --
#
# Against the plain-torch device's versions, which are transformers' own
# arithmetic op for op: equal but for the order of RMSNorm's sum of squares.

GLUE_TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("cols", [64, 200, 2048])
def test_rms_norm_matches_transformers_arithmetic(device, cols, with_residual):
    from sagellm_plugin_torch.devices import TorchDevice

    g = torch.Generator().manual_seed(cols)
    for dtype in dtypes_on(device):
        # Rows of a wider tensor: the kernel reads them through their stride.
        wide = (3 * torch.randn(7, cols + 16, generator=g)).to(dtype).to(device)
        x = wide[:, :cols]
        weight = torch.randn(cols, generator=g).to(dtype).to(device)
        residual = torch.randn(7, cols, generator=g).to(dtype).to(device) if with_residual else None
        expected_residual = None if residual is None else residual.clone()
        expected = TorchDevice().rms_norm(x.clone(), weight, 1e-5, expected_residual)
        out = triton_kernels.rms_norm(x, weight, 1e-5, residual)
        assert relative_error(out, expected) < GLUE_TOLERANCE[dtype]
        if with_residual:
            assert torch.equal(residual, expected_residual), "the residual stream is the rounded sum"


def test_silu_and_mul_matches_transformers_arithmetic(device):
    from sagellm_plugin_torch.devices import TorchDevice

    g = torch.Generator().manual_seed(1)
    for dtype in dtypes_on(device):
        x = (4 * torch.randn(5, 2 * 1500, generator=g)).to(dtype).to(device)
        out = triton_kernels.silu_and_mul(x)
        assert relative_error(out, TorchDevice().silu_and_mul(x)) < GLUE_TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"), [(8, 2, 64, 16), (6, 3, 128, 8), (4, 4, 32, 5)]
)
def test_rotary_write_kv_matches_transformers_arithmetic(device, heads, kv_heads, head_dim, block_size):
    from sagellm_plugin_torch.devices import AttentionBatch, TorchDevice

    g = torch.Generator().manual_seed(heads * head_dim)
    tokens, num_blocks = 11, 6
    for dtype in dtypes_on(device):
        # Q, K and V as the fused decoder has them: views into one projection's output.
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
        q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        angles = torch.rand(tokens, head_dim // 2, generator=g) * 40
        cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype).to(device)
        sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype).to(device)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
        slots[[2, 7]] = -1  # padding rows write nowhere
        kv = torch.randn(1, 2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype).to(device)
        expected_kv = kv.clone()
        batch = AttentionBatch(
            slot_mapping=slots.to(device),
            query_lens=(),
            seq_lens=(),
            block_tables=torch.zeros(0, 0, dtype=torch.int32),
            block_size=block_size,
            all_decode=False,
            seq_lens_tensor=torch.zeros(0, dtype=torch.int32),
            query_start=(),
        )
        written = slots >= 0
        reference = TorchDevice()
        # The reference has no padding rule: it writes the non-padding rows only, and rotates every query.
        only_written = attrs.evolve(batch, slot_mapping=slots[written].to(device))
        rows = written.to(device)
        reference.rotary_write_kv(q[rows], k[rows], v[rows], cos[rows], sin[rows], expected_kv, 0, only_written)
        expected_q = reference.rotary_write_kv(
            q, k, v, cos, sin, kv.clone(), 0, attrs.evolve(batch, slot_mapping=slots.clamp(min=0).to(device))
        )
        q_out = triton_kernels.rotary_write_kv(q, k, v, cos, sin, kv[0, 0], kv[0, 1], slots.to(device))
        assert torch.equal(q_out, expected_q)
        assert torch.equal(kv, expected_kv)


# ------------------------------------------------------------------- errors --


def test_refuses_bad_input_in_one_line():
    k_cache = torch.randn(4, 16, 2, 64)
    v_cache = torch.randn(4, 16, 2, 64)
    query = torch.randn(3, 8, 64)
    out = torch.empty_like(query)
    tables = torch.zeros(3, 2, dtype=torch.int32)
    seq_lens = torch.ones(3, dtype=torch.int32)
    workspace = triton_kernels.decode_workspace(3, 8, 64, 2, "cpu")

    def decode(**changes):
        args = dict(
            query=query,
            k_cache=k_cache,
            v_cache=v_cache,
            block_tables=tables,
            seq_lens=seq_lens,
            scale=0.125,
            out=out,
            num_splits=2,
            workspace=workspace,
        )
        args.update(changes)
        triton_kernels.paged_decode_attention(**args)

    cases = [
        (lambda: decode(query=torch.randn(3, 7, 64)), "multiple of"),
        (lambda: decode(query=query.half()), "caches' torch.float32"),
        (lambda: decode(out=out[:2]), "out (2, 8, 64)"),
        (lambda: decode(block_tables=tables.long()), "block_tables"),
        (lambda: decode(seq_lens=seq_lens[:2]), "seq_lens"),
        (lambda: decode(num_splits=0), "num_splits 0"),
        (lambda: decode(workspace=workspace[:10]), "needs 3120 float32"),
        (lambda: decode(workspace=None), "workspace None"),
        (lambda: decode(v_cache=v_cache[:3]), "v_cache (3, 16, 2, 64)"),
        (lambda: decode(k_cache=k_cache.double(), v_cache=v_cache.double()), "dtype torch.float64"),
        (lambda: triton_kernels.check_supported(0, 64, torch.float16), "block_size 0"),
        (lambda: triton_kernels.check_supported(16, 512, torch.float16), "head_dim 512"),
        (
            lambda: triton_kernels.write_kv(
                torch.randn(5, 2, 64), torch.randn(5, 2, 64), k_cache, v_cache, torch.zeros(5, dtype=torch.int16)
            ),
            "slot_mapping",
        ),
        (
            lambda: triton_kernels.paged_prefill_attention(
                query,
                k_cache,
                v_cache,
                tables,
                torch.zeros(3, dtype=torch.int32),
                seq_lens,
                0.125,
                out,
                max_query_len=1,
            ),
            "query_start_loc (3,)",
        ),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=re.escape(words)) as raised:
            call()
        assert "\n" not in str(raised.value)
