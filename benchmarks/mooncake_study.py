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
   since its last one, by turns so far: whether recency predicts reuse.

Plain Python, no project imports: about 15 s.
"""

from __future__ import annotations

import collections
import json
import math
import sys
from pathlib import Path

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


def simulate(chains, next_use, total, capacity, dead_first=False):
    """LRU over evictable leaves; with ``dead_first`` blocks never used again
    go first (an oracle)."""
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
                victim = next(
                    v for queue in (dead, live) for v in queue if v not in in_use and children[v] == 0
                )
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
    for name, band in (("before depth 4", range(0, 4)), ("depth 4 to 15", range(4, 16)), ("depth 16 on", range(16, 1 << 30))):
        blocks = [h for h, d in first_depth.items() if d in band]
        print(f"blocks first seen {name}: {len(blocks)}, used again: {sum(uses[h] > 1 for h in blocks) / len(blocks):.0%}")


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
    print("turns so far | requests | P(ever) | " + " | ".join(f"{a}-{b if b < 1 << 30 else '...'}" for a, b in zip(edges, edges[1:])))
    for t, g in sorted(gaps.items()):
        cells = []
        for a, b in zip(edges, edges[1:]):
            alive = sum(1 for x in g if x >= a)
            cells.append(f"{sum(1 for x in g if a <= x < b) / alive:.2f}" if alive else "-")
        ever = sum(1 for x in g if x < math.inf) / len(g)
        print(f"{t}{'+' if t == 4 else ''} | {len(g)} | {ever:.2f} | " + " | ".join(cells))


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    chains, next_use, total = load(path)
    print("capacity (blocks) | LRU | dead-first oracle")
    for capacity in (2000, 5000, 10000, 20000, 50000):
        lru = simulate(chains, next_use, total, capacity)
        oracle = simulate(chains, next_use, total, capacity, dead_first=True)
        print(f"{capacity} | {lru:.4f} | {oracle:.4f}", flush=True)
    partial = load(path, partial_blocks=True)
    print(f"LRU at 10000 with partial last blocks cacheable (the trace README's model): {simulate(*partial, 10000):.4f}")
    reuse_gaps(chains)
    hazard(chains)


if __name__ == "__main__":
    main()
