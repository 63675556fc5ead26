"""BucketBatchSampler and eval_shards: coverage across ranks, ordering, determinism and resumption."""

import pytest

from data.sampler import EVAL_LENGTH_SPREAD, BucketBatchSampler, epoch_seed, eval_shards

# 103 distinct durations from 1 to 16 s in scrambled order; 103 is prime, so every batch size leaves a remainder.
DURATIONS = [1 + (37 * index % 103) * 15 / 102 for index in range(103)]
GLOBAL_BATCH = 8


def rank_batches(world_size: int, epoch: int, **kwargs) -> list[list[list[int]]]:
    """For each rank, the index lists it yields in `epoch`."""
    per_rank = []
    for rank in range(world_size):
        sampler = BucketBatchSampler(DURATIONS, GLOBAL_BATCH, rank=rank, world_size=world_size, **kwargs)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    return per_rank


def spread(batch: list[int]) -> float:
    lengths = [DURATIONS[index] for index in batch]
    return max(lengths) - min(lengths)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("epoch", [0, 1, 2])
def test_rank_shards_tile_each_global_batch_without_overlap(world_size, epoch):
    global_batches = BucketBatchSampler(DURATIONS, GLOBAL_BATCH).global_batches(epoch)
    per_rank = rank_batches(world_size, epoch)
    assert len(global_batches) == 103 // GLOBAL_BATCH
    for rank_batch_lists in per_rank:
        assert len(rank_batch_lists) == len(global_batches)  # every rank takes the same number of steps
    for step, global_batch in enumerate(global_batches):
        shards = [per_rank[rank][step] for rank in range(world_size)]
        assert all(len(shard) == GLOBAL_BATCH // world_size for shard in shards)
        assert sum(shards, []) == global_batch  # contiguous shards in rank order
    seen = sum(global_batches, [])
    assert len(seen) == len(set(seen)) == len(global_batches) * GLOBAL_BATCH


def test_global_batch_must_split_evenly_across_ranks():
    with pytest.raises(ValueError, match="global_batch_size 6 .* world_size 4"):
        BucketBatchSampler(DURATIONS, 6, rank=0, world_size=4)
    for rank in (4, -1):  # rank -1 took the empty slice [-2:0] of every global batch
        with pytest.raises(ValueError, match=rf"^rank {rank} is not in a world of size 4$"):
            BucketBatchSampler(DURATIONS, 8, rank=rank, world_size=4)
    with pytest.raises(ValueError, match="^3 utterances do not fill one global batch of global_batch_size 4$"):
        BucketBatchSampler([1.0, 2.0, 3.0], 4)
    # Over 2 ranks too: a check against a rank's shard of 2 let 3 utterances through to epochs of no steps.
    with pytest.raises(ValueError, match="^3 utterances do not fill one global batch of global_batch_size 4$"):
        BucketBatchSampler([1.0, 2.0, 3.0], 4, rank=0, world_size=2)
    # 0 splits evenly across any world, into shards of none: it reached len() and divided by zero.
    with pytest.raises(ValueError, match="^global_batch_size 0 must be a positive multiple of world_size 1$"):
        BucketBatchSampler(DURATIONS, 0)
    # The smallest settings each check lets through: a batch of one, and utterances that fill exactly one batch.
    assert list(BucketBatchSampler([1.0], 1)) == [[0]]
    assert sorted(sum(BucketBatchSampler([1.0, 2.0, 3.0, 4.0], 4, rank=1, world_size=2).global_batches(0), [])) == [
        0, 1, 2, 3]


def test_sortagrad_epoch_goes_shortest_first_then_epochs_shuffle():
    sampler = BucketBatchSampler(DURATIONS, GLOBAL_BATCH)
    first_epoch = sampler.global_batches(0)
    for earlier, later in zip(first_epoch, first_epoch[1:]):
        assert max(DURATIONS[i] for i in earlier) <= min(DURATIONS[i] for i in later)
    assert set(sum(first_epoch, [])) == set(sorted(range(103), key=DURATIONS.__getitem__)[: 12 * GLOBAL_BATCH])
    without_sortagrad = BucketBatchSampler(DURATIONS, GLOBAL_BATCH, sortagrad=False)
    for shuffled in (sampler.global_batches(1), without_sortagrad.global_batches(0)):
        shortest = [min(DURATIONS[i] for i in batch) for batch in shuffled]
        assert shortest != sorted(shortest)


def test_batches_group_similar_lengths_every_epoch():
    # Sorted order packs 8 of these 103 durations into about 1.1 s; random batches would span about 12 s.
    for epoch in range(4):
        batches = BucketBatchSampler(DURATIONS, GLOBAL_BATCH).global_batches(epoch)
        assert max(spread(batch) for batch in batches) < 4.0
        assert sum(spread(batch) for batch in batches) / len(batches) < 2.5


def test_order_depends_on_seed_and_epoch_only():
    assert rank_batches(2, epoch=3, seed=5) == rank_batches(2, epoch=3, seed=5)
    epoch1, epoch2 = (BucketBatchSampler(DURATIONS, GLOBAL_BATCH).global_batches(epoch) for epoch in (1, 2))
    assert epoch1 != epoch2
    assert BucketBatchSampler(DURATIONS, GLOBAL_BATCH, seed=1).global_batches(1) != epoch1
    assert BucketBatchSampler(DURATIONS, GLOBAL_BATCH, rank=1, world_size=2).global_batches(1) == epoch1
    # The jitter regroups the epoch's utterances, not only reorders the groups of their length-sorted order (the
    # utterances each epoch leaves out differ anyway, so comparing two epochs' groups would not show it).
    def groups(sampler):
        return {tuple(sorted(batch)) for batch in sampler.global_batches(1)}

    assert groups(BucketBatchSampler(DURATIONS, GLOBAL_BATCH)) != groups(
        BucketBatchSampler(DURATIONS, GLOBAL_BATCH, jitter=0.0))


def mixed_batches(durations: list[float], **kwargs) -> int:
    """Global batches of 8 over 20 shuffled epochs that hold more than one of `durations`' lengths."""
    sampler = BucketBatchSampler(durations, 8, sortagrad=False, **kwargs)
    batches = [batch for epoch in range(20) for batch in sampler.global_batches(epoch)]
    return sum(len({durations[i] for i in batch}) > 1 for batch in batches)


def test_the_jitter_lengthens_and_shortens_durations():
    # 8 utterances of 1.0 s and 8 of 1.15 s in global batches of 8: only a jitter that can shorten a duration by up to
    # 10 % (1.15 * 0.9 < 1.0 * 1.1) ever puts both lengths in one batch; no jitter, or one that only lengthens, never.
    durations = [1.0] * 8 + [1.15] * 8
    assert mixed_batches(durations, jitter=0.0) == 0 and mixed_batches(durations, jitter=0.1) > 0


def test_the_default_jitter_of_training_mixes_lengths_15_but_not_25_percent_apart():
    # Training takes the default (train.training_batches passes none): a default of 0.05 or 0.15 passed every test.
    # +-10 % lets 1.15 s fall below 1.0 s (1.15 * 0.9 < 1.0 * 1.1) but never 1.25 s (1.25 * 0.9 > 1.0 * 1.1).
    assert mixed_batches([1.0] * 8 + [1.15] * 8) > 0
    assert mixed_batches([1.0] * 8 + [1.25] * 8) == 0


def test_neighbouring_seeds_do_not_share_their_orders_an_epoch_apart():
    for epoch in range(1, 4):
        assert (BucketBatchSampler(DURATIONS, GLOBAL_BATCH, seed=5).global_batches(epoch + 1)
                != BucketBatchSampler(DURATIONS, GLOBAL_BATCH, seed=6).global_batches(epoch))


def test_seeds_do_not_share_their_orders_any_number_of_epochs_apart_in_a_long_run():
    # seed * 2 + epoch passed the test above: seeds 5 and 6 trained on the same batches two epochs apart.
    assert len({epoch_seed(seed, epoch) for seed in range(10) for epoch in range(1000)}) == 10 * 1000


def test_the_dropped_remainder_leaves_out_every_utterance_alike():
    # 7 of 103 utterances left out an epoch: each should train in about 93 % of epochs. Dropping from the ends of the
    # sorted order had the shortest and longest train in a third to two thirds of them.
    sampler = BucketBatchSampler(DURATIONS, GLOBAL_BATCH)
    epochs = range(1, 301)
    times_seen = [0] * len(DURATIONS)
    for epoch in epochs:
        for index in sum(sampler.global_batches(epoch), []):
            times_seen[index] += 1
    expected = len(epochs) * 12 * GLOBAL_BATCH / len(DURATIONS)
    assert 0.9 * expected <= min(times_seen) and max(times_seen) <= len(epochs), (min(times_seen), expected)


def test_iteration_counts_position_and_rolls_into_the_next_epoch():
    sampler = BucketBatchSampler(DURATIONS, GLOBAL_BATCH)
    assert sampler.state_dict() == {"epoch": 0, "position": 0}
    iterator = iter(sampler)
    for _ in range(3):
        next(iterator)
    assert sampler.state_dict() == {"epoch": 0, "position": 3}
    assert len(list(iterator)) == len(sampler) - 3
    assert sampler.state_dict() == {"epoch": 1, "position": 0}
    assert list(sampler) == sampler.global_batches(1)  # a second pass is the next epoch
    sampler.load_state_dict({"epoch": 1, "position": len(sampler)})  # saved after an epoch's last batch
    assert list(sampler) == [] and sampler.state_dict() == {"epoch": 2, "position": 0}


@pytest.mark.parametrize("saved_world_size, resumed_world_size", [(1, 1), (2, 2), (2, 4), (4, 1)])
def test_resume_continues_with_the_next_global_batch_at_any_world_size(saved_world_size, resumed_world_size):
    epoch, consumed = 2, 5
    saved = BucketBatchSampler(DURATIONS, GLOBAL_BATCH, rank=saved_world_size - 1, world_size=saved_world_size)
    saved.set_epoch(epoch)
    iterator = iter(saved)
    for _ in range(consumed):
        next(iterator)
    state = saved.state_dict()
    assert state == {"epoch": epoch, "position": consumed}

    expected = saved.global_batches(epoch)[consumed:]
    resumed_shards = []
    for rank in range(resumed_world_size):
        resumed = BucketBatchSampler(DURATIONS, GLOBAL_BATCH, rank=rank, world_size=resumed_world_size)
        resumed.load_state_dict(state)
        resumed.set_epoch(epoch)  # what a training loop does at the top of each epoch: keeps the position
        resumed_shards.append(list(resumed))
    assert [sum(step, []) for step in zip(*resumed_shards)] == expected


def test_set_epoch_to_another_epoch_starts_it_from_the_beginning():
    sampler = BucketBatchSampler(DURATIONS, GLOBAL_BATCH)
    sampler.load_state_dict({"epoch": 1, "position": 4})
    sampler.set_epoch(2)
    assert sampler.state_dict() == {"epoch": 2, "position": 0}
    sampler.load_state_dict({"epoch": 3, "position": 4})
    sampler.set_epoch(1)  # back, too: a check for a later epoch only kept epoch 3 at position 4
    assert sampler.state_dict() == {"epoch": 1, "position": 0}
    with pytest.raises(ValueError, match="position 13"):
        sampler.load_state_dict({"epoch": 0, "position": 13})
    # A checkpoint from the first epoch, and one from the start of an epoch, resume as saved.
    for state in ({"epoch": 0, "position": 3}, {"epoch": 3, "position": 0}):
        sampler.load_state_dict(state)
        assert sampler.state_dict() == state
    for state in ({"epoch": 0, "position": 0.5}, {"epoch": 1.0, "position": 0}, {"epoch": -1, "position": 0}):
        with pytest.raises(ValueError, match="must be integers|is negative"):  # a checkpoint edited by hand
            sampler.load_state_dict(state)
    # Taken, position -1 would train the epoch's last global batch first and then the whole epoch.
    with pytest.raises(ValueError, match="^sampler position -1 is outside an epoch of 12 global batches$"):
        sampler.load_state_dict({"epoch": 0, "position": -1})


def test_equal_durations_keep_their_manifest_order():
    # Every rank sorts for itself, and the ranks agree because ties keep the manifest's order: torch's unstable argsort
    # reorders equal values from about 50 of them up, as its implementation happens to.
    durations = [1.0 + index % 3 for index in range(60)]
    manifest_order = sorted(range(60), key=durations.__getitem__)
    assert sum(BucketBatchSampler(durations, 4).global_batches(0), []) == manifest_order
    assert eval_shards(durations, 2, batch_size=30) == [[manifest_order[0::2]], [manifest_order[1::2]]]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eval_shards_covers_every_utterance_once_in_length_sorted_batches(world_size):
    shards = eval_shards(DURATIONS, world_size, batch_size=5)
    everything = [index for shard in shards for batch in shard for index in batch]
    assert sorted(everything) == list(range(103))
    for shard in shards:
        assert all(1 <= len(batch) <= 5 for batch in shard)
        lengths = [DURATIONS[index] for batch in shard for index in batch]
        assert lengths == sorted(lengths)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert eval_shards(DURATIONS[:2], 1, batch_size=1) == [[[0], [1]]]
    # Batch k of every rank comes from the same stretch of the sorted order: their duration ranges overlap.
    for k in range(min(map(len, shards))):
        ranges = [(min(DURATIONS[i] for i in shard[k]), max(DURATIONS[i] for i in shard[k])) for shard in shards]
        assert max(low for low, _ in ranges) <= min(high for _, high in ranges), (k, ranges)


def test_every_ranks_kth_evaluation_batch_holds_the_same_stretch_of_lengths():
    """Ranks wait for each other at every evaluation batch. Each rank cut its own batches, so rank 0's batch k could
    hold lengths of another rank's batch k+1, and one rank wait on another's longer batch."""
    assert eval_shards([1.0, 1.5, 3.0, 4.5, 5.0, 5.5], 2, batch_size=16) == [[[0], [2, 4]], [[1], [3, 5]]]
    for world_size in (2, 3, 4):
        # batches of 50 are cut where DURATIONS' lengths spread, not where the batches fill
        assert_kth_batches_share_a_stretch(eval_shards(DURATIONS, world_size, batch_size=50))


def assert_kth_batches_share_a_stretch(shards: list[list[list[int]]]) -> None:
    """The world's k-th batches of DURATIONS together span at most EVAL_LENGTH_SPREAD, below its (k+1)-th's."""
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    worlds_batches = [[index for shard in shards if k < len(shard) for index in shard[k]]
                      for k in range(max(map(len, shards)))]
    for k, batch in enumerate(worlds_batches):
        lengths = [DURATIONS[index] for index in batch]
        assert max(lengths) <= EVAL_LENGTH_SPREAD * min(lengths), (k, lengths)
        if k + 1 < len(worlds_batches):
            assert max(lengths) <= min(DURATIONS[index] for index in worlds_batches[k + 1]), k


def test_a_long_recording_among_short_ones_is_evaluated_in_a_batch_of_its_own():
    # Padded to in a batch of 16, a 10-minute file among AN4 clips made trainer.evaluate take 547 s and 6.3 GB on a
    # CPU instead of 13 s and 1.0 GB.
    durations = [2.0, 600.0, 1.5, 3.0, 2.5, 1.0]
    assert eval_shards(durations, 1, batch_size=16) == [[[5, 2, 0, 4, 3], [1]]]
    at_the_limit = [1.0, 4.0, 4.5, 2.0]  # four times the shortest, as README says, and no more
    assert eval_shards(at_the_limit, 1, batch_size=16) == [[[0, 3, 1], [2]]]
    assert eval_shards(at_the_limit, 1, batch_size=2) == [[[0, 3], [1, 2]]]


def test_eval_shards_refuses_an_empty_world_or_batch_naming_the_argument():
    # eval_shards takes no rank: "rank 0 is not in a world of size 0" named one the caller never gave.
    with pytest.raises(ValueError, match="^world_size must be positive, got 0$"):
        eval_shards(DURATIONS, 0, batch_size=5)
    with pytest.raises(ValueError, match="^batch_size must be positive, got 0$"):
        eval_shards(DURATIONS, 2, batch_size=0)
