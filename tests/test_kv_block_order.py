"""The KV pool hands out its lowest free block first, whatever order sequences were freed in: a
store that served a batch lays out the next one as a fresh store does (the blocks one decode step
starts side by side), so attention reads neighbouring sequences from neighbouring memory."""
import random

import numpy as np
import pytest

from rpart.kernels import KVStore

LAYERS, HEADS, DIM, BLOCK = 2, 2, 16, 4


def store():
    return KVStore(LAYERS, HEADS, DIM, 1 << 20, block_size=BLOCK, num_threads=1, populate=False)


def decode_tokens(s, ids, steps, rng):
    for _ in range(steps):
        for layer in range(LAYERS):
            k = rng.standard_normal((len(ids), HEADS, DIM)).astype(np.float32)
            s.append(layer, ids, k, k)


def layout(s, ids):
    return [[s.block_ids(i, layer) for layer in range(LAYERS)] for i in ids]


def test_a_batch_after_a_batch_gets_the_layout_of_a_fresh_store():
    rng = np.random.default_rng(0)
    fresh, reused = store(), store()
    ids = list(range(8))
    fresh.create(ids)
    decode_tokens(fresh, ids, 10, rng)
    expected = layout(fresh, ids)
    assert expected[0][0] == [0, 2 * 8, 4 * 8]        # per step: layer 0 for all, then layer 1

    reused.create(ids)
    decode_tokens(reused, ids, 10, rng)
    order = ids[:]
    random.Random(1).shuffle(order)
    for i in order:                                 # finished in any order
        reused.free([i])
    later = [100 + i for i in ids]
    reused.create(later)
    decode_tokens(reused, later, 10, rng)
    assert layout(reused, later) == expected


def test_a_new_sequence_takes_the_lowest_blocks_freed():
    rng = np.random.default_rng(1)
    s = store()
    s.create([1, 2, 3])
    decode_tokens(s, [1, 2, 3], BLOCK, rng)          # one block per sequence and layer
    freed = sorted(s.block_ids(3, 0) + s.block_ids(3, 1) + s.block_ids(1, 0) + s.block_ids(1, 1))
    s.free([3])
    s.free([1])
    s.create([4])
    decode_tokens(s, [4], 1, rng)
    assert s.block_ids(4, 0) + s.block_ids(4, 1) == freed[:2]
    stats = s.stats()
    assert stats["blocks_used"] == 4


@pytest.mark.parametrize("seq_id, layer, error", [(99, 0, KeyError), (1, LAYERS, ValueError), (1, -1, ValueError),
                                                   ("x", 0, ValueError), (1, 0.5, ValueError)])
def test_block_ids_of_garbage_is_a_clear_error(seq_id, layer, error):
    s = store()
    s.create([1])
    with pytest.raises(error):
        s.block_ids(seq_id, layer)
