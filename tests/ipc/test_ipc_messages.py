"""Fast unit tests of folio.ipc.messages / transport (no model, no processes)."""

import msgpack
import numpy as np
import pytest

from folio.ipc import messages as M
from folio.ipc.transport import check_address
from folio.runtime.common.sampling_params import SamplingParams
from folio.runtime.common.step import NewSequence, StepPlan, StepResult


def _plan(rng, S=5, T=23):
    return StepPlan(
        step_id=7,
        input_ids=rng.integers(0, 49152, T, dtype=np.int64),
        positions=rng.integers(0, 100, T, dtype=np.int64),
        slot_mapping=rng.integers(-1, 1000, T, dtype=np.int64),
        query_start_loc=np.sort(rng.integers(0, T, S + 1)).astype(np.int32),
        seq_lens=rng.integers(1, 100, S, dtype=np.int32),
        block_tables=rng.integers(0, 60, (S, 7), dtype=np.int32),
        seq_ids=np.arange(S, dtype=np.int64),
        logits_indices=np.arange(S, dtype=np.int64),
        sample_seq_ids=np.arange(S, dtype=np.int64),
        new_seqs=[NewSequence(3, [1, 2, 3], [], SamplingParams(temperature=0.5, stop=["x"]).to_dict(), 11, [2]),
                  NewSequence(4, list(range(300)), [9], SamplingParams().to_dict(), None, [])],
        finished_seq_ids=[1, 2],
        block_copies=np.array([[3, 4]], dtype=np.int64),
    )


def test_plan_round_trip_arrays_are_frames_not_lists():
    plan = _plan(np.random.default_rng(0))
    frames = M.encode_plan(plan)
    header = msgpack.unpackb(frames[0], raw=False)
    assert header["v"] == M.PROTOCOL_VERSION and header["type"] == "step"
    # every array is a descriptor pointing at a raw frame, never a list of numbers
    assert set(header["input_ids"]) == {"__nd__", "dtype", "shape"}
    assert set(header["new_seqs"]["ints"]) == {"__nd__", "dtype", "shape"}   # the sequences' token ids
    assert len(frames) == 12                # a fixed frame count, however many sequences start
    assert len(frames[0]) < 2000          # the 300-token prompt is not in the header
    got = M.plan_from_fields(M.decode([bytes(f) for f in frames])[1])
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                 "seq_ids", "logits_indices", "sample_seq_ids", "block_copies"):
        a, b = getattr(plan, name), getattr(got, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    assert got.new_seqs == plan.new_seqs
    assert got.finished_seq_ids == [1, 2] and got.step_id == 7


def test_result_round_trip_with_and_without_logprobs():
    r = StepResult(3, np.array([5, 6], np.int64), np.ones((2, 3), np.float32), np.zeros((2, 3), np.int64), 0.5, 0.25)
    g = M.result_from_fields(M.decode(M.encode_result(r))[1])
    assert np.array_equal(g.sampled_token_ids, r.sampled_token_ids) and np.array_equal(g.logprobs, r.logprobs)
    assert g.logprobs.dtype == np.float32 and g.logprob_token_ids.shape == (2, 3)
    assert (g.forward_time, g.sample_time, g.error) == (0.5, 0.25, None)
    r2 = StepResult(4, np.zeros(0, np.int64), error="boom")
    g2 = M.result_from_fields(M.decode(M.encode_result(r2))[1])
    assert g2.logprobs is None and g2.error == "boom" and g2.sampled_token_ids.shape == (0,)


def _gen(**over):
    fields = dict(request_id="r1", prompt="hi", sampling={"max_tokens": 3})
    fields.update(over)
    return M.encode("generate", **fields)


@pytest.mark.parametrize("frames, needle", [
    ([b"\xc1\xff garbage"], "not valid msgpack"),
    ([msgpack.packb([1, 2, 3])], "must be a msgpack map"),
    ([msgpack.packb({"v": 99, "type": "generate"})], "protocol version"),
    ([msgpack.packb({"v": M.PROTOCOL_VERSION, "type": "nope"})], "unknown message type"),
    ([msgpack.packb({"v": M.PROTOCOL_VERSION, "type": "generate", "request_id": "a"})], "missing field 'sampling'"),
    ([msgpack.packb({"v": M.PROTOCOL_VERSION, "type": "generate", "request_id": 5, "sampling": {}})],
     "'request_id' must be str"),
    ([msgpack.packb({"v": M.PROTOCOL_VERSION, "type": "generate", "request_id": "a", "sampling": {}, "x": 1})],
     "unknown field 'x'"),
    ([msgpack.packb({"v": M.PROTOCOL_VERSION, "type": "abort", "request_id": True})], "must be str"),
    ([], "empty message"),
])
def test_malformed_messages_raise_message_error(frames, needle):
    with pytest.raises(M.MessageError, match=needle):
        M.decode(frames)


def test_request_id_is_recovered_for_the_error_reply():
    bad = msgpack.packb({"v": M.PROTOCOL_VERSION, "type": "generate", "request_id": "abc", "sampling": 3})
    with pytest.raises(M.MessageError) as ei:
        M.decode([bad])
    assert ei.value.request_id == "abc"


def test_array_descriptor_checks():
    frames = _gen(prompt=None, prompt_token_ids=np.arange(4, dtype=np.int64))
    M.decode(frames)                                           # valid
    with pytest.raises(M.MessageError, match="bytes"):         # frame length disagrees with shape
        M.decode([frames[0], b"\0" * 8])
    with pytest.raises(M.MessageError, match="not referenced"):
        M.decode([*frames, b"extra"])
    h = msgpack.unpackb(frames[0])
    h["prompt_token_ids"]["dtype"] = "|O"
    with pytest.raises(M.MessageError, match="dtype"):
        M.decode([msgpack.packb(h), frames[1]])
    h["prompt_token_ids"].update(dtype="<i8", __nd__=5)
    with pytest.raises(M.MessageError, match="frame index"):
        M.decode([msgpack.packb(h), frames[1]])


def test_size_limits():
    frames = _gen(prompt="x" * 5000)
    with pytest.raises(M.MessageError, match="too large"):
        M.decode(frames, max_message_bytes=1000)
    assert M.decode(frames, max_message_bytes=10_000)[1]["prompt"] == "x" * 5000
    # a 5-byte header claiming a 4 GiB string must not allocate: the unpacker's limits reject it
    with pytest.raises(M.MessageError):
        M.decode([b"\xdb\xff\xff\xff\xff"])
    with pytest.raises(M.MessageError, match="too many frames"):
        M.decode([frames[0]] + [b""] * M.MAX_FRAMES)


def test_decoded_arrays_view_the_frames_without_copy():
    ids = np.arange(1000, dtype=np.int64)
    frames = M.encode("generate", request_id="r", prompt_token_ids=ids, sampling={})
    buf = bytearray(frames[1])
    got = M.decode([frames[0], buf])[1]["prompt_token_ids"]
    buf[0:8] = (77).to_bytes(8, "little")
    assert got[0] == 77       # shares memory with the received frame


def test_check_address_loopback_by_default():
    assert check_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    assert check_address("tcp://localhost:1")
    assert check_address("ipc:///tmp/x.sock")
    for bad in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://8.8.8.8:80"):
        with pytest.raises(ValueError, match="allow-remote"):
            check_address(bad)
        assert check_address(bad, allow_remote=True) == bad
    for bad in ("http://x", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "ipc://"):
        with pytest.raises(ValueError):
            check_address(bad)


def test_step_with_inconsistent_new_sequence_counts_is_rejected():
    plan = _plan(np.random.default_rng(1))
    frames = M.encode_plan(plan)
    h = msgpack.unpackb(frames[0], raw=False)
    h["new_seqs"]["rows"][0]["prompt_token_ids"] = 10_000     # the row's count of prompt ids
    with pytest.raises(M.MessageError, match="new_seqs\\[0\\]"):
        M.plan_from_fields(M.decode([msgpack.packb(h), *frames[1:]])[1])
    h["new_seqs"]["rows"][0]["prompt_token_ids"] = 2     # one id left over
    with pytest.raises(M.MessageError, match="longer"):
        M.plan_from_fields(M.decode([msgpack.packb(h), *frames[1:]])[1])


def test_a_new_dataclass_field_travels_with_no_other_edit(monkeypatch):
    """The wire form comes from the dataclass alone: a message type with one field of each wire
    form (and a list of rows with token-id lists) round-trips, and its own fields are checked."""
    from dataclasses import dataclass, field

    @dataclass
    class Row:
        key: int
        ids: list[int]
        more_ids: list[int]
        note: str | None = None

    @dataclass
    class Probe:
        name: str
        count: int
        weights: np.ndarray
        rows: list[Row]
        scale: float = 1.0
        tags: list[int] = field(default_factory=list)
        extra: dict | None = None
        mask: np.ndarray | None = None

    monkeypatch.setitem(M.MESSAGES, "probe", Probe)
    msg = Probe("p", 3, np.arange(6, dtype=np.float32).reshape(2, 3),
                [Row(1, [5, 6, 7], []), Row(2, [], [9], "n")], tags=[4, 5], extra={"a": np.ones(2, np.int64)})
    frames = M.encode_message("probe", msg)
    assert len(frames) == 4          # header, weights, the rows' packed ids, extra's array
    t, f = M.decode([bytes(x) for x in frames])
    got = Probe(**f)
    assert t == "probe" and got.name == "p" and got.count == 3 and got.scale == 1.0 and got.tags == [4, 5]
    assert got.rows == msg.rows and got.mask is None
    assert np.array_equal(got.weights, msg.weights) and got.weights.dtype == np.float32
    assert np.array_equal(got.extra["a"], [1, 1])
    header = msgpack.unpackb(frames[0], raw=False)
    assert "mask" not in header and header["rows"]["rows"][0] == {"key": 1, "ids": 3, "more_ids": 0, "note": None}
    for bad, needle in [({"count": "3"}, "'count' must be int"), ({"name": None}, "'name' must not be null"),
                        ({"tags": [1, "x"]}, "list of ints"), ({"scale": True}, "must be float, got bool")]:
        h = dict(header, **bad)
        with pytest.raises(M.MessageError, match=needle):
            M.decode([msgpack.packb(h), *frames[1:]])
    h = dict(header)
    del h["count"]
    with pytest.raises(M.MessageError, match="missing field 'count'"):
        M.decode([msgpack.packb(h), *frames[1:]])
    h = msgpack.unpackb(frames[0], raw=False)
    h["rows"]["rows"][1]["bogus"] = 1
    with pytest.raises(M.MessageError, match=r"rows\[1\]: unknown field 'bogus'"):
        M.decode([msgpack.packb(h), *frames[1:]])
    with pytest.raises(KeyError):
        M.encode("probe", name="p", colour="red")       # a field the type does not have
