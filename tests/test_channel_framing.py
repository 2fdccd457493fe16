"""Framing: pure encode/decode round trips and every way a frame can be wrong."""

import pickle
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keepalive_executor.channel import (
    DEFAULT_INLINE_BYTES,
    FORMAT_VERSION,
    HEADER_SIZE,
    POLL_MAX_S,
    POLL_MIN_S,
    SPIN_S,
    ChannelProtocolError,
    FrameHeader,
    MessageKind,
    PollSchedule,
    SequenceChecker,
    decode_header,
    encode_header,
)
from keepalive_executor.rpc import RpcSerializationError, deserialize, serialize

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml

LIMIT = 1 << 30

headers = st.builds(
    FrameHeader,
    kind=st.just(MessageKind.PAYLOAD),
    seq=st.integers(min_value=1, max_value=2**64 - 1),
    length=st.integers(min_value=0, max_value=LIMIT),
) | st.builds(
    FrameHeader,
    kind=st.sampled_from([MessageKind.KEEPALIVE, MessageKind.SHUTDOWN]),
    seq=st.integers(min_value=1, max_value=2**64 - 1),
    length=st.just(0),
)


@given(headers)
def test_header_round_trip(header):
    raw = encode_header(header)
    assert len(raw) == HEADER_SIZE
    assert decode_header(raw, LIMIT) == header


@given(headers, st.data())
def test_any_single_byte_corruption_of_the_header_is_detected(header, data):
    raw = bytearray(encode_header(header))
    pos = data.draw(st.integers(min_value=0, max_value=27), label="byte")
    flip = data.draw(st.integers(min_value=1, max_value=255), label="xor")
    raw[pos] ^= flip
    with pytest.raises(ChannelProtocolError):
        decode_header(bytes(raw), LIMIT)


@given(st.integers(min_value=0, max_value=HEADER_SIZE - 1))
def test_truncated_frame_is_rejected(n):
    raw = encode_header(FrameHeader(MessageKind.PAYLOAD, 1, 3))[:n]
    with pytest.raises(ChannelProtocolError, match="truncated"):
        decode_header(raw, LIMIT)


def _forge(version=FORMAT_VERSION, kind=1, seq=1, length=0, magic=b"KAch"):
    import zlib

    head = struct.pack("<4sHHQQ", magic, version, kind, seq, length)
    return head + struct.pack("<II", zlib.crc32(head), 0)


def test_wrong_version_names_both_versions():
    with pytest.raises(ChannelProtocolError, match=f"version 9.*speaks {FORMAT_VERSION}"):
        decode_header(_forge(version=9), LIMIT)


def test_unknown_kind_and_bad_magic():
    with pytest.raises(ChannelProtocolError, match="unknown message kind 7"):
        decode_header(_forge(kind=7), LIMIT)
    with pytest.raises(ChannelProtocolError, match="magic"):
        decode_header(_forge(magic=b"XXXX"), LIMIT)


def test_length_above_limit_and_keepalive_with_payload():
    with pytest.raises(ChannelProtocolError, match="above the limit"):
        decode_header(_forge(length=101), 100)
    with pytest.raises(ChannelProtocolError, match="KEEPALIVE frame with a 5-byte"):
        decode_header(_forge(kind=2, length=5), LIMIT)


@given(st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=30))
def test_sequence_checker_accepts_only_consecutive(seqs):
    checker = SequenceChecker()
    expected = 1
    for s in seqs:
        if s == expected:
            checker.check(s)
            expected += 1
        else:
            with pytest.raises(ChannelProtocolError, match="repeated|gap"):
                checker.check(s)
            # a failed check does not advance the checker
            assert checker.last_seq == expected - 1


payloads = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
    | st.binary(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner) | st.tuples(inner, inner),
    max_leaves=20,
)


@given(payloads)
def test_serialize_round_trip(obj):
    assert deserialize(serialize(obj)) == obj


def test_callables_fall_back_to_cloudpickle_and_load_with_plain_pickle():
    offset = 41
    fn = lambda x: x + offset  # noqa: E731 - a lambda is the point
    data = serialize(fn)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(fn)
    assert pickle.loads(data)(1) == 42


def test_unpicklable_object_raises_serialization_error():
    import threading

    with pytest.raises(RpcSerializationError, match="cannot serialize"):
        serialize(threading.Lock())


def test_default_inline_capacity_is_the_documented_16_kib():
    """docs/design.md and docs/usage.md give 16384 bytes (one collective per decode step)."""
    assert DEFAULT_INLINE_BYTES == 16384


# ---------------------------------------------------------------- the polling wait (pure)


def _first_look_after(schedule: PollSchedule, arrival: float, look_cost: float) -> float:
    """When a wait on ``schedule`` first looks at or after ``arrival`` (seconds into the
    wait), each look costing ``look_cost`` on top of its sleep."""
    t, previous = 0.0, None
    while t < arrival:
        previous = schedule.delay(t, previous)
        t += previous + look_cost
    return t


@given(arrival=st.floats(0, 3.0), spin=st.sampled_from([0.0, 0.005, SPIN_S]),
       after_step=st.booleans())
def test_a_frame_is_seen_within_the_spin_cost_while_spinning_and_poll_max_after(
        arrival, spin, after_step):
    schedule = PollSchedule(spin_s=spin)
    schedule.note(MessageKind.PAYLOAD if after_step else MessageKind.KEEPALIVE)
    cost = 1e-6
    late = _first_look_after(schedule, arrival, cost) - arrival
    if after_step and arrival < spin:
        assert late <= POLL_MIN_S + cost  # "spinning": looking every POLL_MIN_S
    else:
        assert late <= POLL_MAX_S + cost


def test_the_spin_is_armed_by_a_step_only_and_the_backoff_doubles_to_its_cap():
    schedule = PollSchedule(spin_s=0.01)
    assert schedule.delay(0.0, None) == POLL_MIN_S  # a new channel: idle, backing off
    assert schedule.delay(0.001, POLL_MIN_S) == 2 * POLL_MIN_S
    schedule.note(MessageKind.PAYLOAD)  # a step: look every POLL_MIN_S for spin_s
    assert schedule.delay(0.0, None) == POLL_MIN_S
    assert schedule.delay(0.0099, POLL_MIN_S) == POLL_MIN_S
    delays, previous = [], POLL_MIN_S
    for _ in range(12):
        previous = schedule.delay(0.02, previous)
        delays.append(previous)
    assert delays[0] == 2 * POLL_MIN_S and delays[-1] == POLL_MAX_S
    assert all(b == min(2 * a, POLL_MAX_S) for a, b in zip(delays, delays[1:], strict=False))
    schedule.note(MessageKind.KEEPALIVE)  # the engine is idle: no spin
    assert schedule.delay(0.0001, POLL_MIN_S) == 2 * POLL_MIN_S
