"""What limits eviction on the Mooncake conversation trace: a stand-alone
study at the level of the trace's 512-token blocks, for designing policies.

    python3 benchmarks/mooncake_study.py [TRACE]

It uses the replay's semantics (only full blocks are cached, a request hits
the leading run of its blocks that is cached, eviction takes leaves only,
every hash_id counts in the denominator), which it checks by reproducing the
replay's LRU figure (0.2149 at 10,000 blocks). It prints:

1. LRU's block hit rate against capacity, and at 10,000 blocks under the
   trace README's model (partial last blocks cacheable too: its 0.211);
2. the hit rate of an oracle that evicts blocks that are never used again
   first (then LRU): how much a perfect dead-block predictor is worth;
3. how far apart uses of a block are (in requests), by its number of
   earlier uses, how many distinct blocks are used only once, and how
   often a block is used again by the depth at which it was first seen;
4. the hazard of a conversation's next turn against the requests elapsed
   since its last one, by turns so far: whether recency predicts reuse;
5. how well a predictor of a conversation's end must tell ended chains from
   continued ones (AUC) to reach a hit rate, and how well what is
   observable about a request does.

Python and numpy, no project imports: about 15 s.
"""

from __future__ import annotations

import collections
import json
import math
import random
import sys
from pathlib import Path

import numpy

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake_conversation.jsonl"


def load(path, partial_blocks=False):
    """Chains of the blocks a cache may hold: full blocks only, as engines
    (and the replay) cache them, or with ``partial_blocks`` every hash_id, as
    the trace README's model does."""
    rows = [json.loads(line) for line in open(path)]
    chains = [r["hash_ids"] if partial_blocks else r["hash_ids"][: r["input_length"] // 512] for r in rows]
    total = sum(len(r["hash_ids"]) for r in rows)
    # For each request, the index of the next request using each of its blocks.
    next_use, last = [None] * len(chains), {}
    for i in range(len(chains) - 1, -1, -1):
        next_use[i] = [last.get(h, math.inf) for h in chains[i]]
        for h in chains[i]:
            last[h] = i
    return chains, next_use, total


def simulate(chains, next_use, total, capacity, dead_first=False, predicted_dead=None):
    """LRU over evictable leaves; with ``dead_first`` blocks never used again
    go first (an oracle); with ``predicted_dead(request index, chain, next
    use of the block)`` the blocks it calls dead go first."""
    cached, parent, children = set(), {}, collections.Counter()
    live, dead = collections.OrderedDict(), collections.OrderedDict()
    hits = 0
    for i, chain in enumerate(chains):
        n = 0
        for h in chain:
            if h not in cached:
                break
            n += 1
        hits += n
        for h in chain[:n]:
            live.pop(h, None)
            dead.pop(h, None)
        in_use = set(chain)
        for d, h in enumerate(chain):
            if h in cached:
                continue
            while len(cached) >= capacity:
                victim = next(v for queue in (dead, live) for v in queue if v not in in_use and children[v] == 0)
                cached.discard(victim)
                live.pop(victim, None)
                dead.pop(victim, None)
                p = parent.pop(victim)
                if p is not None:
                    children[p] -= 1
            cached.add(h)
            parent[h] = chain[d - 1] if d else None
            if d:
                children[chain[d - 1]] += 1
        for h, nxt in zip(reversed(chain), reversed(next_use[i])):  # leaves first
            if predicted_dead is not None:
                queue = dead if predicted_dead(i, chain, nxt) else live
            else:
                queue = dead if dead_first and nxt == math.inf else live
            queue[h] = None
            queue.move_to_end(h)
    return hits / total


def reuse_gaps(chains):
    last, uses = {}, collections.Counter()
    gaps = collections.defaultdict(list)
    for i, chain in enumerate(chains):
        for h in chain:
            if h in last:
                gaps[min(uses[h], 3)].append(i - last[h])
            uses[h] += 1
            last[h] = i
    print("\nrequests between uses of a block, by its earlier uses")
    print("earlier uses | reuses | p50 | p90")
    for k, g in sorted(gaps.items()):
        g.sort()
        print(f"{k}{'+' if k == 3 else ''} | {len(g)} | {g[len(g) // 2]} | {g[int(len(g) * 0.9)]}")
    once = sum(1 for n in uses.values() if n == 1)
    print(f"distinct full blocks: {len(uses)}, used once: {once} ({once / len(uses):.0%})")
    # Whether depth tells reuse apart (the predictive policy's depth bands,
    # and why weighing deep blocks up does not pay in the cost-aware one).
    first_depth = {}
    for chain in chains:
        for depth, h in enumerate(chain):
            first_depth.setdefault(h, depth)
    for name, band in (
        ("before depth 4", range(0, 4)),
        ("depth 4 to 15", range(4, 16)),
        ("depth 16 on", range(16, 1 << 30)),
    ):
        blocks = [h for h, d in first_depth.items() if d in band]
        print(
            f"blocks first seen {name}: {len(blocks)}, used again: {sum(uses[h] > 1 for h in blocks) / len(blocks):.0%}"
        )


def hazard(chains):
    turns = collections.defaultdict(list)
    for i, chain in enumerate(chains):
        if len(chain) > 1:
            turns[chain[1]].append(i)  # a conversation: its first private block
    gaps = collections.defaultdict(list)
    for requests in turns.values():
        for k, i in enumerate(requests):
            gap = requests[k + 1] - i if k + 1 < len(requests) else math.inf
            gaps[min(k + 1, 4)].append(gap)
    edges = [0, 50, 100, 200, 400, 800, 1600, 3200, 6400, 1 << 30]
    print("\nnext-turn hazard by requests since the last turn (P(next turn in bin | none before))")
    print(
        "turns so far | requests | P(ever) | "
        + " | ".join(f"{a}-{b if b < 1 << 30 else '...'}" for a, b in zip(edges, edges[1:]))
    )
    for t, g in sorted(gaps.items()):
        cells = []
        for a, b in zip(edges, edges[1:]):
            alive = sum(1 for x in g if x >= a)
            cells.append(f"{sum(1 for x in g if a <= x < b) / alive:.2f}" if alive else "-")
        ever = sum(1 for x in g if x < math.inf) / len(g)
        print(f"{t}{'+' if t == 4 else ''} | {len(g)} | {ever:.2f} | " + " | ".join(cells))


def auc(scores, labels):
    """Area under the ROC curve: the chance a positive outscores a negative."""
    order = sorted(range(len(scores)), key=scores.__getitem__)
    ranks, i = [0.0] * len(scores), 0
    while i < len(order):  # average ranks over ties
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    positives = sum(labels)
    negatives = len(labels) - positives
    return (sum(r for r, y in zip(ranks, labels) if y) - positives * (positives + 1) / 2) / (positives * negatives)


def continuation_needed(chains, next_use, total, capacity=10_000):
    """How good must a prediction of a chain's end be? A request's last block
    is used again when its conversation goes on. The oracle's knowledge of
    that, seen through noise (score = continued × separation + N(0, 1), one
    draw per request), is used as the dead-first oracle uses its own: the
    request's private blocks go first when the score says it ended. Beside
    it, how well what is observable tells continued chains apart: turns so
    far, blocks the turn added, chain length, and a logistic regression on
    those and the gap before the turn (the ``continuation`` eviction
    policy's features; the gap here in requests, not seconds)."""
    rng = random.Random(0)
    ends = [i for i, c in enumerate(chains) if len(c) > 1]
    continued = {i: next_use[i][-1] < math.inf for i in ends}
    print(
        f"\nrequests with two full blocks or more: {len(ends)}, continued (last block used again): "
        f"{sum(continued.values())}"
    )
    print(f"continuation predictor quality (AUC) against the hit rate its dead-first use gives at {capacity} blocks")
    print("separation | AUC | block hit rate")
    for separation in (0.0, 1.0, 2.0, 3.0):
        score = {i: continued[i] * separation + rng.gauss(0.0, 1.0) for i in ends}

        def predicted_dead(i, chain, nxt, score=score, separation=separation):
            # its private blocks only (told apart by their next use, as an oracle
            # may): a shared block's use says nothing of this conversation
            return i in score and score[i] < separation / 2 and nxt == next_use[i][-1]

        rate = simulate(chains, next_use, total, capacity, predicted_dead=predicted_dead)
        a = auc([score[i] for i in ends], [continued[i] for i in ends])
        print(f"{separation} | {a:.3f} | {rate:.4f}", flush=True)
    # What is observable, per request: its predecessor is the latest request
    # whose whole chain (two blocks or more) this one extends.
    end_at, turns, gap, added = {}, {}, {}, {}
    for j, chain in enumerate(chains):
        previous = next(
            (end_at[h] for h in reversed(chain[1:]) if h in end_at and len(chains[end_at[h]]) == chain.index(h) + 1),
            None,
        )
        turns[j] = turns[previous] + 1 if previous is not None else 1
        gap[j] = j - previous if previous is not None else None
        added[j] = len(chain) - (len(chains[previous]) if previous is not None else 0)
        if chain:
            end_at[chain[-1]] = j
    labels = [continued[i] for i in ends]
    print("observable | AUC")
    print(f"turns so far | {auc([turns[i] for i in ends], labels):.3f}")
    print(f"fewer blocks added by the turn | {auc([-added[i] for i in ends], labels):.3f}")
    print(f"shorter chain | {auc([-len(chains[i]) for i in ends], labels):.3f}")
    # Fitted to the whole trace in hindsight (Newton's method), so a bound
    # on what a linear model of these features can tell apart.
    x = numpy.array(
        [
            [
                1.0,
                math.log(turns[i]),
                math.log1p(added[i]),
                math.log1p(len(chains[i])),
                0.0 if gap[i] is None else math.log1p(gap[i]),
                float(gap[i] is None),
            ]
            for i in ends
        ]
    )
    y = numpy.array(labels, dtype=float)
    w = numpy.zeros(x.shape[1])
    for _ in range(25):
        p = 1.0 / (1.0 + numpy.exp(-(x @ w)))
        w += numpy.linalg.solve((x * (p * (1 - p))[:, None]).T @ x + 1e-6 * numpy.eye(len(w)), x.T @ (y - p))
    print(
        f"logistic regression on all of them and the gap before the turn, fitted in hindsight | "
        f"{auc(list(x @ w), labels):.3f}"
    )


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    chains, next_use, total = load(path)
    print("capacity (blocks) | LRU | dead-first oracle")
    for capacity in (2000, 5000, 10000, 20000, 50000):
        lru = simulate(chains, next_use, total, capacity)
        oracle = simulate(chains, next_use, total, capacity, dead_first=True)
        print(f"{capacity} | {lru:.4f} | {oracle:.4f}", flush=True)
    partial = load(path, partial_blocks=True)
    print(
        f"LRU at 10000 with partial last blocks cacheable (the trace README's model): {simulate(*partial, 10000):.4f}"
    )
    reuse_gaps(chains)
    hazard(chains)
    continuation_needed(chains, next_use, total)


if __name__ == "__main__":
    main()
