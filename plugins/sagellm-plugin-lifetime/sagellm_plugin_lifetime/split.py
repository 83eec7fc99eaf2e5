"""Which requests a lifetime predictor may learn from, which ones choices are
made on, and which ones it is scored on: three parts, by whole conversation.

* ``train``: what the ``text`` model is fitted on (and what every predictor
  observes as finished in an evaluation);
* ``dev``: what every choice is made on: the ``text`` model's early stopping,
  and every study (``benchmarks/lifetime_study.py`` reads
  :func:`study_requests`, which never yields a test request);
* ``test``: read only by ``sagellm lifetime evaluate``, and reported.

The unit is the *conversation*: ShareGPT V3 cuts a long conversation into
parts (``hRPPgZT_0``, ``hRPPgZT_11``, ...), each its own ``session_id``;
:func:`conversation_id` strips the part suffix so that every part of a
conversation falls on the same side (held-out parts used to share their
conversation, even their text, with training parts).

Two kinds of split:

* ``conversation``: a stable hash of the conversation id, the lowest
  ``test_fraction`` held out for test, the next ``dev_fraction`` for dev;
* ``temporal``: by the order in which conversations first arrive in the
  workload (ShareGPT: file order): the last ``test_fraction`` of them are the
  test, the ``dev_fraction`` before them the dev set, the rest (the earliest)
  training. Its order comes from one pass over the whole workload
  (:func:`make_split`), never from a cut one (``max_requests``), so the same
  conversations are held out for training and for evaluation.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping

import attrs
from attrs import field, frozen, validators

from sagellm_core.config import WorkloadSettings
from sagellm_core.types import Request

TEST_FRACTION = 0.1
DEV_FRACTION = 0.1
KINDS = ("conversation", "temporal")
PARTS = ("train", "dev", "test")

#: ShareGPT's part suffix: ``hRPPgZT_11`` is part 11 of ``hRPPgZT``.
_PART_SUFFIX = re.compile(r"_\d+$")


def conversation_id(request: Request) -> str:
    """The whole conversation a request belongs to: its session id without a
    ShareGPT part suffix (``_<digits>``), or its own id without a session."""
    if request.session_id is None:
        return request.request_id
    return _PART_SUFFIX.sub("", request.session_id)


def conversation_draw(conversation: str) -> float:
    """A stable draw in [0, 1) for a conversation, in any process."""
    digest = hashlib.blake2b(conversation.encode(), digest_size=8, person=b"lifetime").digest()
    return int.from_bytes(digest, "little") / 2**64


def _fraction(instance, attribute, value) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"{attribute.name} = {value!r}: in [0, 1)")


@frozen
class Split:
    """A three-way split of conversations; :meth:`part` names a request's."""

    kind: str = field(default="conversation", validator=validators.in_(KINDS))
    test_fraction: float = field(default=TEST_FRACTION, converter=float, validator=_fraction)
    dev_fraction: float = field(default=DEV_FRACTION, converter=float, validator=_fraction)
    #: ``temporal`` only: conversation id -> its rank in first-arrival order
    #: over the number of conversations, in [0, 1).
    order: Mapping[str, float] = field(factory=dict, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.test_fraction + self.dev_fraction >= 1:
            raise ValueError(f"test_fraction + dev_fraction = {self.test_fraction + self.dev_fraction}: below 1")
        if self.kind == "temporal" and not self.order:
            raise ValueError("a temporal split needs the conversations' order (make_split)")

    def part_of(self, conversation: str) -> str:
        if self.kind == "conversation":
            x = conversation_draw(conversation)
            return (
                "test" if x < self.test_fraction else "dev" if x < self.test_fraction + self.dev_fraction else "train"
            )
        # Conversations outside the ordered workload are new: the latest of all.
        x = self.order.get(conversation, 1.0)
        if x >= 1 - self.test_fraction:
            return "test"
        return "dev" if x >= 1 - self.test_fraction - self.dev_fraction else "train"

    def part(self, request: Request) -> str:
        return self.part_of(conversation_id(request))


def arrival_order(conversations: Iterable[str]) -> dict[str, float]:
    """Conversation id -> rank of its first arrival / number of
    conversations, from the conversation ids of requests in arrival order."""
    seen = dict.fromkeys(conversations)
    return {c: i / len(seen) for i, c in enumerate(seen)}


def make_split(
    kind: str = "conversation",
    workload: WorkloadSettings | None = None,
    test_fraction: float = TEST_FRACTION,
    dev_fraction: float = DEV_FRACTION,
    requests: Iterable[Request] | None = None,
) -> Split:
    """The split of ``kind``; a temporal one orders the conversations of
    ``requests`` if given, else of the whole ``workload`` (its
    ``max_requests`` ignored, so that a cut evaluation holds out what the
    full training held out)."""
    if kind != "temporal":
        return Split(kind, test_fraction, dev_fraction)
    if requests is None:
        if workload is None:
            raise ValueError("a temporal split needs a workload or requests")
        from sagellm_core.replay import workloads

        requests = workloads.load(attrs.evolve(workload, max_requests=None))
    return Split(kind, test_fraction, dev_fraction, arrival_order(map(conversation_id, requests)))


def held_out(request: Request, fraction: float = TEST_FRACTION) -> bool:
    """Whether ``request`` is in the test part of the default (conversation)
    split with ``fraction`` held out."""
    return conversation_draw(conversation_id(request)) < fraction


def study_requests(requests: Iterable[Request], split: Split) -> Iterator[tuple[Request, str]]:
    """(request, part) for every request of the ``train`` and ``dev`` parts,
    in order: what a study may read. Test requests are dropped here, before
    anything (a feature, a near-duplicate memory) could see them."""
    for request in requests:
        part = split.part(request)
        if part != "test":
            yield request, part
