"""The data-parallel routing policy alone (ipc/routing.py): no Ray, no processes."""

import pytest

from folio.ipc.routing import NoReplicaError, PrefixAwareRouter
from folio.model.tokenizer import Tokenizer
from folio.runtime.inputs.input_processor import InputProcessor
from folio.runtime.scheduler.kv_cache_utils import extend_block_hashes

BS = 4


def prompt(prefix_id, n_prefix_blocks, tail):
    """A prompt of ``n_prefix_blocks`` blocks shared by every prompt with the same ``prefix_id``,
    then the distinct ``tail``."""
    return [1000 * prefix_id + j for j in range(n_prefix_blocks * BS)] + list(tail)


def test_keys_are_the_replicas_chain_and_separate_salts():
    r = PrefixAwareRouter(2, BS, 100)
    ids = list(range(11))
    # the same chain as a replica's KV manager computes (same process root here): 2 full blocks
    assert r.block_keys(ids) == extend_block_hashes([], ids, BS)
    assert len(r.block_keys(ids)) == 2
    assert r.block_keys(ids, "a")[0] != r.block_keys(ids)[0]
    assert r.block_keys(ids, "a")[1] != r.block_keys(ids, "b")[1]   # the salt reaches every later block
    assert r.block_keys(ids[:8]) == r.block_keys(ids)                # a partial block has no key


def test_shared_prefix_goes_to_its_replica_others_spread():
    r = PrefixAwareRouter(2, BS, 1000)
    a = r.route(prompt(1, 3, [7, 8]), max_tokens=4)
    b = r.route(prompt(2, 3, [7, 8]), max_tokens=4)
    assert a.replica != b.replica and not a.by_prefix and not b.by_prefix   # unrelated: least loaded
    for tail in ([1], [2, 3], [9] * 5):
        d = r.route(prompt(1, 3, tail), max_tokens=4)
        assert (d.replica, d.by_prefix, d.matched_blocks) == (a.replica, True, 3)
        d2 = r.route(prompt(2, 3, tail), max_tokens=4)
        assert (d2.replica, d2.by_prefix) == (b.replica, True)


def test_longest_prefix_wins_and_partial_match_counts():
    r = PrefixAwareRouter(2, BS, 1000)
    long = r.route(prompt(1, 4, []))                       # 4 blocks -> replica x
    r.release(long)
    short = r.route(prompt(1, 1, [5, 5, 5, 5]))            # shares block 0 only; remaps block keys 0 and 1
    r.release(short)
    assert short.replica == long.replica and short.matched_blocks == 1
    d = r.route(prompt(1, 4, [3]))
    assert d.replica == long.replica and d.matched_blocks == 4


def test_salt_separates_routing():
    r = PrefixAwareRouter(2, BS, 1000)
    ids = prompt(1, 3, [])
    a = r.route(ids, cache_salt="tenant-a")
    b = r.route(ids, cache_salt="tenant-b")
    assert not b.by_prefix and b.replica != a.replica      # same tokens, other salt: no affinity
    assert r.route(ids, cache_salt="tenant-a").replica == a.replica


def test_least_loaded_by_outstanding_tokens_and_release():
    r = PrefixAwareRouter(3, BS, 1000)
    big = r.route(list(range(100, 140)), max_tokens=60)     # cost 100
    mid = r.route(list(range(200, 210)), max_tokens=10)     # cost 20
    assert {big.replica, mid.replica} == {0, 1}
    third = r.route([1, 2, 3], max_tokens=1)                # the idle replica
    assert third.replica == 2
    nxt = r.route([9, 9], max_tokens=1)                     # fewest outstanding tokens: the cost-4 one
    assert nxt.replica == third.replica
    assert r.replicas[2].outstanding_tokens == 4 + 3
    r.release(big)
    assert r.replicas[big.replica].outstanding_tokens == 0
    assert r.route([5], max_tokens=0).replica == big.replica


def test_ties_rotate():
    r = PrefixAwareRouter(3, BS, 1000)
    seen = []
    for k in range(6):
        d = r.route([k], max_tokens=0)    # shorter than a block: no keys; cost 1
        r.release(d)
        seen.append(d.replica)
    assert seen == [0, 1, 2, 0, 1, 2]


def test_overloaded_owner_loses_to_the_least_loaded():
    r = PrefixAwareRouter(2, BS, 1000, balance_abs_tokens=50)
    first = r.route(prompt(1, 2, []), max_tokens=100)       # owner now carries 108 tokens
    d = r.route(prompt(1, 2, [1]), max_tokens=1)            # 108 - 0 > 8 matched tokens: the load wins
    assert d.replica != first.replica and not d.by_prefix
    r.release(first)
    r.release(d)
    # the block keys now map to d's replica (the newest copy)
    assert r.route(prompt(1, 2, [2])).replica == d.replica


def test_lru_bound_evicts_the_oldest_keys():
    r = PrefixAwareRouter(2, BS, max_blocks=4)
    a = r.route(prompt(1, 2, []))
    r.release(a)
    b = r.route(prompt(2, 2, []))
    r.release(b)
    assert r.num_prefix_entries() == 4
    c = r.route(prompt(3, 2, []))                            # evicts prefix 1's two keys
    r.release(c)
    assert r.num_prefix_entries() == 4
    assert not r.route(prompt(1, 2, [5])).by_prefix
    assert r.route(prompt(3, 2, [5])).by_prefix


def test_dead_replica_loses_its_keys_and_takes_nothing():
    r = PrefixAwareRouter(2, BS, 1000)
    a = r.route(prompt(1, 2, []), max_tokens=5)
    r.set_alive(a.replica, False)
    assert r.replicas[a.replica].outstanding_tokens == 0
    for k in range(4):
        d = r.route(prompt(1, 2, [k]))
        assert d.replica != a.replica
    r.set_alive(1 - a.replica, False)
    with pytest.raises(NoReplicaError):
        r.route([1, 2, 3])
    r.set_alive(a.replica, True)                             # rejoins empty
    d = r.route(prompt(1, 2, [9]))
    assert d.replica == a.replica and not d.by_prefix


def test_exclude():
    r = PrefixAwareRouter(2, BS, 1000)
    a = r.route(prompt(1, 2, []))
    d = r.route(prompt(1, 2, [1]), exclude=[a.replica])
    assert d.replica != a.replica
    with pytest.raises(NoReplicaError):
        r.route([1], exclude=[0, 1])


def test_bad_sizes():
    with pytest.raises(ValueError):
        PrefixAwareRouter(0, BS, 10)
    with pytest.raises(ValueError):
        PrefixAwareRouter(2, 0, 10)


def test_owner_is_chosen_while_ahead_by_at_most_its_matched_tokens():
    # the bound: the prefix holder may be ahead of the least loaded by the prefill it saves
    r = PrefixAwareRouter(2, BS, 1000)
    a = r.route(prompt(1, 5, []), max_tokens=0)             # 20 tokens on replica a
    d = r.route(prompt(1, 5, [1]), max_tokens=0)            # ahead by 20 <= 5 blocks x 4 tokens: affinity
    assert (d.replica, d.by_prefix) == (a.replica, True)
    e = r.route(prompt(1, 5, [2]), max_tokens=0)            # ahead by 41 > 20: the other replica
    assert e.replica != a.replica and not e.by_prefix
    r2 = PrefixAwareRouter(2, BS, 1000, balance_abs_tokens=10)
    a2 = r2.route(prompt(1, 5, []), max_tokens=0)
    assert r2.route(prompt(1, 5, [1]), max_tokens=0).replica != a2.replica   # 20 > the cap of 10


BLOCK = 16    # the replicas' default block_size


@pytest.fixture(scope="module")
def chat_inputs(default_model_dir):
    return InputProcessor(Tokenizer.from_pretrained(default_model_dir), 4096)


def _chat_ids(inputs, turns):
    return inputs.tokenize(inputs.render_chat(turns), param="messages")


QUESTIONS = ["What is the capital of France?", "Name three prime numbers.", "How do bees make honey?",
             "Translate 'good morning' to Spanish.", "Why is the sky blue?", "Write a haiku about rain.",
             "What is 17 times 23?", "Who wrote Hamlet?"]


def test_concurrent_chats_sharing_a_template_spread(chat_inputs):
    """Eight chats at once: the default model's template gives each the same first blocks (its
    system prompt), so prefix affinity alone sent all eight to one replica; within the load bound
    they spread evenly, as the least-loaded rule alone would spread them."""
    prompts = [_chat_ids(chat_inputs, [{"role": "user", "content": q}]) for q in QUESTIONS]
    shared = min(next((j for j, (x, y) in enumerate(zip(prompts[0], p)) if x != y), len(p)) for p in prompts[1:])
    assert shared >= BLOCK, "the template gives the chats at least one full block in common"
    r = PrefixAwareRouter(2, BLOCK, 10_000)
    decisions = [r.route(ids, max_tokens=256) for ids in prompts]      # all in flight together
    per_replica = [sum(d.replica == i for d in decisions) for i in (0, 1)]
    assert per_replica == [4, 4], per_replica
    assert r.replicas[0].num_requests == r.replicas[1].num_requests == 4


def test_a_follow_up_turn_goes_back_to_its_conversation(chat_inputs):
    """A second turn shares its whole first turn (many blocks): it goes to the replica that holds
    them while the loads are within that bound, though the template's blocks were remapped since."""
    r = PrefixAwareRouter(2, BLOCK, 10_000)
    long_answer = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    first_turns = [[{"role": "user", "content": q}, {"role": "assistant", "content": long_answer + q}]
                   for q in QUESTIONS[:4]]
    placed = [r.route(_chat_ids(chat_inputs, t), max_tokens=64) for t in first_turns]
    assert {d.replica for d in placed} == {0, 1}
    for d in placed:
        r.release(d)
    for turns, d in zip(first_turns, placed):
        follow_up = _chat_ids(chat_inputs, turns + [{"role": "user", "content": "And then?"}])
        again = r.route(follow_up, max_tokens=64)
        assert again.replica == d.replica and again.by_prefix and again.matched_blocks * BLOCK >= 100
        r.release(again)
