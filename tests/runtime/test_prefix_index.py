"""runtime/prefix_index.py: the radix tree answers as a scan over every entry would (the spec
below), through random inserts, lookups and evictions of entries with shared prefixes, and the
tree stays well formed (counts right, no dead nodes)."""

import random

import numpy as np

from distributed.runtime.prefix_index import Entry, PrefixIndex, common_prefix


def best_tokens(entries, prompt) -> int:
    """The most of `prompt` any entry saves: a prefix of all but its last token whole, or a
    trimmable entry cut to the common prefix (at most all but the last token)."""
    best = 0
    for e in entries:
        common = common_prefix(e.tokens, prompt)
        if common == len(e.tokens) < len(prompt):
            best = max(best, common)
        elif e.trimmable:
            best = max(best, min(common, len(prompt) - 1))
    return best


def serves(entries, tokens) -> bool:
    """An entry of the same tokens, or a trimmable one that extends them."""
    return any(common_prefix(e.tokens, tokens) == len(tokens)
               and (len(e.tokens) == len(tokens) or e.trimmable) for e in entries)


def check_tree(index: PrefixIndex) -> None:
    seen = []

    def visit(node, prefix):
        tokens = np.concatenate([prefix, node.run])
        if node is not index._root:
            assert node.entry is not None or len(node.children) >= 2, "a dead or unmerged node"
        if node.entry is not None:
            assert np.array_equal(node.entry.tokens, tokens) and index._nodes[node.entry.id] is node
            seen.append(node.entry.id)
        for key, child in node.children.items():
            assert child.parent is node and int(child.run[0]) == key
            visit(child, tokens)
        below = sum(c.trimmable for c in node.children.values())
        assert node.trimmable == below + bool(node.entry is not None and node.entry.trimmable)

    visit(index._root, np.zeros(0, dtype=np.int32))
    assert sorted(seen) == sorted(index.entries)


def test_random_operations_match_a_scan_over_every_entry():
    rng = random.Random(0)
    index = PrefixIndex(budget=12, ranks=2)
    stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 8))] for _ in range(5)]

    def tokens():  # a shared stem and a tail: prefixes overlap often, at any length
        return np.array(rng.choice(stems)[:rng.randrange(0, 8)] + [rng.randrange(4) for _ in range(rng.randrange(4))]
                        or [rng.randrange(4)], dtype=np.int32)

    next_id = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.4:
            prompt = tokens()
            entries = list(index.entries.values())
            entry, got = index.find(prompt)
            assert got == best_tokens(entries, prompt), (step, prompt, [e.tokens for e in entries])
            if entry is not None:  # the entry it names gives those tokens
                assert common_prefix(entry.tokens, prompt) >= got
                assert entry.trimmable or len(entry.tokens) == got
                assert next(reversed(index.entries)) == entry.id  # most recently used now
        elif op < 0.6:
            t = tokens()
            assert index.covered(t) == serves(list(index.entries.values()), t), step
        else:
            t = tokens()
            if serves(list(index.entries.values()), t):
                continue  # prefix_cache.store() never inserts what is covered
            before = dict(index.entries)
            entry = Entry(next_id, t, rng.random() < 0.7, [rng.randrange(1, 3), rng.randrange(1, 3)])
            next_id += 1
            dropped = index.insert(entry)
            useless = {e.id for e in before.values()
                       if entry.trimmable and common_prefix(e.tokens, t) == len(e.tokens) <= len(t)}
            assert useless <= set(dropped) and set(dropped) <= set(before)
            assert set(index.entries) == set(before) - set(dropped) | {entry.id}
            assert index.bytes == [sum(e.nbytes[r] for e in index.entries.values()) for r in range(2)]
            assert max(index.bytes) <= index.budget or len(index.entries) == 1
            evicted = [i for i in dropped if i not in useless]
            assert evicted == [i for i in before if i not in useless][:len(evicted)]  # least recently used first
        check_tree(index)
    assert next_id > 300


def test_a_lookup_walks_branches_not_entries():
    # Thousands of entries under one shared system prompt: the tree has a node per entry,
    # and a lookup passes two of them.
    index = PrefixIndex(budget=1 << 40, ranks=1)
    system = list(range(1000, 1500))
    for i in range(3000):
        index.insert(Entry(i, np.array(system + [i, i + 1, i + 2], dtype=np.int32), False, [1]))
    path, matched, below = index._walk(np.array(system + [7, 8, 9, 10], dtype=np.int32))
    assert [depth for _, depth in path] == [500, 503] and matched == 503 and below is None
    assert index.find(np.array(system + [7, 8, 9, 10], dtype=np.int32))[1] == 503
    assert len(index._root.children) == 1 and len(path[0][0].children) == 3000


def test_an_entry_of_the_same_tokens_replaces_the_old_one():
    index = PrefixIndex(budget=100, ranks=1)
    index.insert(Entry(0, np.array([1, 2, 3], dtype=np.int32), False, [1]))
    assert index.insert(Entry(1, np.array([1, 2, 3], dtype=np.int32), False, [1])) == [0]
    check_tree(index)
    assert list(index.entries) == [1] and index.find(np.array([1, 2, 3, 4], dtype=np.int32))[0].id == 1
