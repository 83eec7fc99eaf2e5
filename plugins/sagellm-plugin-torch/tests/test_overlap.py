"""``async_scheduling``: step N+1 packed while step N runs, its decodes fed
step N's sampled ids on the device. Over random request mixes (prompts,
max_tokens, stop tokens, arrivals between steps, pools small enough to
preempt) the outputs are the serial loop's, token for token and reason for
reason, and the runtime's block ledger holds after every step and ends
with every block free or cached. Each deterministic run asserts that the
overlapped path did what its name says (fed tokens, dropped a sequence
that stopped, preempted)."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sagellm_plugin_torch import testing as helpers
from sagellm_plugin_torch.engine import SamplingParams

from sagellm_core.types import Request


def engine(folder, model_dir, overlap, **config):
    folder.mkdir(exist_ok=True)
    options = dict(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32) | config
    return helpers.engine_core(helpers.write_config(folder, model=str(model_dir), **options), async_scheduling=overlap)


class Probe:
    """Counts what the overlapped loop did: tokens fed from the running
    step, steps prepared again after a sequence stopped, launches."""

    def __init__(self, core):
        self.fed = self.prepared = self.launched = 0
        feed, prepare, launch = core.runner.inputs.feed, core.prepare, core.launch

        def counting_feed(ids, count, *rest):
            self.fed += count
            return feed(ids, count, *rest)

        def counting_prepare(step, after):
            self.prepared += 1
            return prepare(step, after)

        def counting_launch(step):
            self.launched += 1
            return launch(step)

        core.runner.inputs.feed, core.prepare, core.launch = counting_feed, counting_prepare, counting_launch


def serve(core, mix, arrive_every=1, sampling=None):
    """Run ``mix`` (prompt, max_tokens, stop tokens), one request arriving
    every ``arrive_every`` steps (its ``SamplingParams`` from ``sampling(max_tokens,
    stops)`` where given); the block ledger checked after each step.
    Returns each request's generated ids and finish reason, in order."""
    generated, reasons, streamed = {}, {}, {}
    pending, steps = list(enumerate(mix)), 0
    while pending or core.has_work():
        if pending and steps % arrive_every == 0:
            i, (prompt, max_tokens, stops) = pending.pop(0)
            rid = f"m{i}"
            params = (
                sampling(max_tokens, stops)
                if sampling
                else SamplingParams(max_tokens=max_tokens, stop_token_ids=tuple(stops))
            )
            core.add_request(Request(rid, prompt, max_tokens), params)
            generated[rid] = core.generated_ids(core.requests[rid])
            streamed[rid] = []
        for out in core.step():
            assert out.request_id not in reasons, f"{out.request_id}: an output after it ended"
            streamed[out.request_id].append(out.token_id)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        core.rt.check_invariants()
    rt = core.rt
    assert not core.requests and not core.running and not core.waiting and core.launched is None
    assert rt.pool_usage().num_free_blocks + rt.num_cached_blocks == rt.num_blocks, "a block is still held"
    assert streamed == generated, "the streamed tokens are not the tokens generated"
    return [(generated[f"m{i}"], reasons[f"m{i}"]) for i in range(len(mix))]


mixes = st.lists(
    st.tuples(
        st.lists(st.integers(2, 120), min_size=1, max_size=18),  # the prompt
        st.integers(1, 12),  # max_tokens
        st.sets(st.integers(0, 127), max_size=24),  # stop tokens
    ),
    min_size=1,
    max_size=9,
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    mix=mixes,
    arrive_every=st.integers(0, 2),
    num_blocks=st.integers(8, 40),
    cache=st.booleans(),
    seqs=st.integers(1, 4),
)
def test_outputs_equal_the_serial_loops_and_the_ledger_holds(
    tmp_path, tiny_model_dir, mix, arrive_every, num_blocks, cache, seqs
):
    config = dict(num_blocks=num_blocks, prefix_cache=cache, max_num_seqs=seqs)
    mix = [(p, n, s) for p, n, s in mix if len(p) + n <= num_blocks * 4]  # each fits the pool alone
    if not mix:
        return
    serial = serve(engine(tmp_path / "serial", tiny_model_dir, False, **config), mix, arrive_every or 1)
    overlapped = serve(engine(tmp_path / "overlap", tiny_model_dir, True, **config), mix, arrive_every or 1)
    assert overlapped == serial


def random_mix(seed, count, stops):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(2, 120) for _ in range(rng.randrange(4, 20))],
            rng.randrange(4, 12),
            set(rng.sample(range(128), stops)),
        )
        for _ in range(count)
    ]


def test_decodes_are_fed_the_running_steps_ids(tmp_path, tiny_model_dir):
    mix = random_mix(1, 6, 0)
    serial = serve(engine(tmp_path / "serial", tiny_model_dir, False), mix, 1)
    core = engine(tmp_path / "overlap", tiny_model_dir, True)
    probe = Probe(core)
    assert serve(core, mix, 1) == serial
    assert probe.fed > 0 and probe.launched == core.steps
    assert all(reason == "length" for _, reason in serial)


def test_a_sequence_that_stops_runs_in_the_step_launched_ahead_and_its_token_is_dropped(tmp_path, tiny_model_dir):
    mix = random_mix(2, 8, 40)
    serial = serve(engine(tmp_path / "serial", tiny_model_dir, False), mix, 1)
    assert any(reason == "stop" and len(ids) < 4 for ids, reason in serial), "no request stopped early"
    core = engine(tmp_path / "overlap", tiny_model_dir, True)
    assert serve(core, mix, 1) == serial
    assert core.steps_launched_ahead > 0, "no step was launched before the one ahead of it was applied"
    assert core.tokens_dropped > 0, "no step launched ahead carried a sequence that had stopped"


def test_a_sequence_that_stops_leaves_the_step_packed_after_it(tmp_path, tiny_model_dir):
    """Where a step may not be launched ahead (a mixed step; a constrained
    one), a sequence that stopped leaves it before it is launched."""
    mix = random_mix(2, 8, 40)
    serial = serve(engine(tmp_path / "serial", tiny_model_dir, False), mix, 1)
    core = engine(tmp_path / "overlap", tiny_model_dir, True)
    core.may_launch_ahead = lambda step: False
    probe = Probe(core)
    assert serve(core, mix, 1) == serial
    assert probe.prepared > probe.launched, "no packed step lost a sequence that stopped before it ran"
    assert core.steps_launched_ahead == 0 and core.tokens_dropped == 0


class AcceptBeforeNextMask:
    """A constraint that allows the tokens above the last it accepted
    (wrapping), and fails if its mask is asked for twice without a token
    accepted in between: what a step launched before the tokens ahead of
    it are applied would do."""

    def __init__(self, vocab: int):
        self.vocab, self.last, self.asked = vocab, 0, False

    def fill_bitmask(self, bitmask, row: int) -> None:
        assert not self.asked, "a mask asked for before the last token was accepted"
        self.asked = True
        bitmask[row] = 0
        for t in range(self.last + 1, self.last + 9):
            t %= self.vocab
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)

    def accept(self, token_id: int) -> None:
        assert self.asked
        self.asked, self.last = False, token_id


def test_a_constrained_step_is_not_launched_ahead(tmp_path, tiny_model_dir):
    mix = random_mix(4, 4, 0)

    def constrained(core):
        vocab = core.runner.vocab_size
        return lambda max_tokens, stops: SamplingParams(max_tokens=max_tokens, constraint=AcceptBeforeNextMask(vocab))

    serial_core = engine(tmp_path / "serial", tiny_model_dir, False)
    serial = serve(serial_core, mix, 1, constrained(serial_core))
    core = engine(tmp_path / "overlap", tiny_model_dir, True)
    assert serve(core, mix, 1, constrained(core)) == serial
    assert core.steps > 8 and core.steps_launched_ahead == 0


@pytest.mark.parametrize("cache", [False, True])
def test_preemption_under_pool_pressure(tmp_path, tiny_model_dir, cache):
    mix = random_mix(3, 8, 12)
    config = dict(num_blocks=12, prefix_cache=cache)
    serial_core = engine(tmp_path / "serial", tiny_model_dir, False, **config)
    serial = serve(serial_core, mix, 1)
    core = engine(tmp_path / "overlap", tiny_model_dir, True, **config)
    assert serve(core, mix, 1) == serial
    assert core.rt.counters.preemptions > 0 and core.rt.counters.reprefill_tokens > 0
