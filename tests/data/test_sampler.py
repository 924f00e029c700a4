"""EpochSampler: deterministic per seed, fresh per epoch, rank-sharded, resumable mid-epoch."""
from __future__ import annotations

import itertools

import pytest

from glm_lora.data.sampler import EpochSampler


def take(sampler, k: int) -> list[int]:
    return list(itertools.islice(sampler, k))


def test_deterministic_for_a_seed():
    assert take(EpochSampler(50, seed=3), 200) == take(EpochSampler(50, seed=3), 200)
    assert take(EpochSampler(50, seed=3), 50) != take(EpochSampler(50, seed=4), 50)


def test_every_index_once_per_epoch_and_epochs_differ():
    s = EpochSampler(37, seed=0)
    epochs = [take(s, 37) for _ in range(4)]
    for e in epochs:
        assert sorted(e) == list(range(37))
    assert len({tuple(e) for e in epochs}) == 4
    assert (s.epoch, s.position) == (3, 37)
    next(s)
    assert (s.epoch, s.position) == (4, 1)


def test_epoch_is_a_function_of_seed_and_epoch_only():
    s = EpochSampler(20, seed=7)
    take(s, 20 * 5)
    fresh = EpochSampler(20, seed=7)
    fresh.load_state_dict({**fresh.state_dict(), "epoch": 5, "position": 0})
    assert take(fresh, 20) == take(s, 20)


def test_no_shuffle_is_in_order():
    assert take(EpochSampler(5, seed=0, shuffle=False), 10) == [0, 1, 2, 3, 4] * 2


@pytest.mark.parametrize("n,world", [(37, 4), (40, 4), (3, 4), (10, 1), (11, 3)])
def test_rank_shards_disjoint_and_covering(n, world):
    for epoch in range(3):
        shards = []
        for r in range(world):
            s = EpochSampler(n, seed=1, rank=r, world_size=world)
            shards.append(take(s, s.num_samples * (epoch + 1))[-s.num_samples:])
        assert len({len(x) for x in shards}) == 1, "ranks must get equal counts"
        flat = [i for x in shards for i in x]
        assert set(flat) == set(range(n))
        assert len(flat) == -(-n // world) * world
        assert len(flat) - len(set(flat)) == len(flat) - n    # only the wrap-around pad repeats
        # padding is the start of the same permutation: the shards interleave one epoch's order
        whole = take(EpochSampler(n, seed=1), n * (epoch + 1))[-n:]
        interleaved = [shards[p % world][p // world] for p in range(len(flat))]
        assert interleaved[:n] == whole


def test_drop_last_shards():
    world, n = 4, 37
    shards = [take(EpochSampler(n, seed=1, rank=r, world_size=world, drop_last=True), 9) for r in range(world)]
    flat = [i for x in shards for i in x]
    assert len(flat) == len(set(flat)) == 36
    with pytest.raises(ValueError, match="drop_last"):
        EpochSampler(3, seed=0, world_size=4, drop_last=True)


def test_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    s = EpochSampler.from_env(10, seed=5)
    assert (s.rank, s.world_size) == (2, 3)
    assert take(s, 4) == take(EpochSampler(10, seed=5, rank=2, world_size=3), 4)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    s = EpochSampler.from_env(10, seed=5, shuffle=False)
    assert (s.rank, s.world_size) == (0, 1) and take(s, 3) == [0, 1, 2]


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 3)])
def test_resume_mid_epoch_continues_exactly(rank, world):
    n, seed = 23, 11
    per_rank = -(-n // world)
    reference = take(EpochSampler(n, seed=seed, rank=rank, world_size=world), 6 * per_rank)
    for k in range(0, 3 * per_rank + 1):
        s = EpochSampler(n, seed=seed, rank=rank, world_size=world)
        assert take(s, k) == reference[:k]
        state = s.state_dict()
        resumed = EpochSampler(n, seed=seed, rank=rank, world_size=world)
        resumed.load_state_dict(state)
        assert (resumed.epoch, resumed.position) == (s.epoch, s.position)
        assert take(resumed, 3 * per_rank) == reference[k:k + 3 * per_rank]


def test_state_is_plain_json():
    import json
    s = EpochSampler(9, seed=1)
    take(s, 4)
    assert json.loads(json.dumps(s.state_dict())) == s.state_dict()


@pytest.mark.parametrize("field,value", [("n", 24), ("seed", 12), ("world_size", 3), ("rank", 1),
                                         ("shuffle", False), ("drop_last", True)])
def test_refuses_mismatched_state(field, value):
    s = EpochSampler(23, seed=11, world_size=2, rank=0)
    take(s, 3)
    state = {**s.state_dict(), field: value}
    if field == "world_size":
        state["rank"] = 0
    with pytest.raises(ValueError, match=f"has {field}="):
        EpochSampler(23, seed=11, world_size=2, rank=0).load_state_dict(state)


def test_refuses_out_of_range_position():
    s = EpochSampler(10, seed=0)
    with pytest.raises(ValueError, match="position"):
        s.load_state_dict({**s.state_dict(), "position": 11})
    with pytest.raises(ValueError, match="'seed'"):
        s.load_state_dict({"epoch": 0, "position": 0, "n": 10, "world_size": 1})
