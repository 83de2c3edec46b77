import mmap
import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from formats.errors import CorruptError, FormatError
from formats.pack import (DTYPES, FLAG_ZSTD, PAGE, PetRecord, append_record, decode_record,
                          encode_record, record_tensor_views, scan)

# In-memory dtype of each on-disk dtype (bfloat16 bits live in uint16 arrays).
MEMORY_DTYPES = [np.dtype(np.uint16) if name == "bfloat16" else dtype for name, dtype in DTYPES.items()]

json_scalars = (st.none() | st.booleans() | st.integers() | st.text()
                | st.floats(allow_nan=False, allow_infinity=False))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@st.composite
def tensors(draw):
    """An array of any pack dtype and a small shape (0-d and empty included), random bytes."""
    dtype = draw(st.sampled_from(MEMORY_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    size = int(np.prod(shape, dtype=np.int64))
    if dtype == np.bool_:
        return np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)), bool).reshape(shape)
    # Raw bytes, so float NaNs and infinities are covered and must come back bit-exact.
    data = draw(st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize))
    return np.frombuffer(data, dtype).reshape(shape)


@st.composite
def records(draw):
    tenant = draw(st.text(max_size=12))
    meta = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=5))
    if draw(st.booleans()):
        return PetRecord(tenant, meta, {}, tombstone=True)
    return PetRecord(tenant, meta, draw(st.dictionaries(st.text(max_size=12), tensors(), max_size=6)))


def assert_same(got: PetRecord, want: PetRecord):
    assert (got.tenant, got.meta, got.tombstone) == (want.tenant, want.meta, want.tombstone)
    assert list(got.tensors) == list(want.tensors)
    for name, array in want.tensors.items():
        assert got.tensors[name].dtype == array.dtype, name
        assert got.tensors[name].shape == array.shape, name
        assert got.tensors[name].tobytes() == array.tobytes(), name


def sample_record(tenant="acme", compressible=False):
    rng = np.random.default_rng(0)
    weight = np.zeros((64, 384), np.float32) if compressible else rng.normal(0, 0.02, (64, 384))
    return PetRecord(tenant, {"tenant": tenant, "pet_type": "adapter", "labels": ["a", "b"]}, {
        "layers.3.adapter.o.down.weight": weight.astype(np.float32),
        "layers.3.adapter.o.down.bias": np.zeros(64, np.float16),
        "layers.3.diff.q.index": np.arange(0, 1000, 7, dtype=np.int32),
    })


def flags_of(data: bytes) -> int:
    return struct.unpack_from("<I", data, 12)[0]


@given(records())
def test_encode_decode_round_trip(record):
    data = encode_record(record)
    assert len(data) % PAGE == 0
    assert_same(decode_record(data), record)
    assert_same(decode_record(memoryview(data), 0, len(data)), record)


@settings(max_examples=30, deadline=None)
@given(st.lists(records(), min_size=1, max_size=4))
def test_append_then_decode_from_mmap(recs):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "000001.pack")
        placed = [append_record(path, record) for record in recs]
        assert all(offset % PAGE == 0 and length % PAGE == 0 for offset, length in placed)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for (offset, length), record in zip(placed, recs):
                assert_same(decode_record(mm, offset, length), record)
        scanned = list(scan(path))
    assert [(offset, length) for offset, length, _ in scanned] == placed
    for (_, _, got), record in zip(scanned, recs):
        assert_same(got, record)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(records(), st.data())
def test_any_flipped_byte_is_detected(record, data):
    """Header, directory, payload and padding are all checked: no flip decodes."""
    encoded = bytearray(encode_record(record))
    position = data.draw(st.integers(0, len(encoded) - 1), label="position")
    encoded[position] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(FormatError, match="PET record at offset 0"):
        decode_record(bytes(encoded))
    with pytest.raises(FormatError):
        record_tensor_views(bytes(encoded), 0, len(encoded))


@given(records(), st.data())
def test_truncation_is_detected(record, data):
    encoded = encode_record(record)
    cut = data.draw(st.integers(0, len(encoded) - 1), label="cut")
    with pytest.raises(CorruptError, match="truncated"):
        decode_record(encoded[:cut])
    with pytest.raises(CorruptError, match="truncated"):
        decode_record(encoded[:cut], 0, len(encoded))


def test_tombstone_round_trips_and_carries_no_tensors():
    tombstone = PetRecord("acme", {"deleted": True}, tombstone=True)
    data = encode_record(tombstone)
    assert len(data) == PAGE
    assert_same(decode_record(data), tombstone)
    with pytest.raises(ValueError, match="tombstone"):
        encode_record(PetRecord("acme", {}, {"x": np.zeros(1, np.float32)}, tombstone=True))


def test_unstorable_dtype_is_refused():
    with pytest.raises(ValueError, match="float64"):
        encode_record(PetRecord("acme", {}, {"x": np.zeros(3)}))


def test_wrong_length_and_offset_are_refused():
    data = encode_record(sample_record())
    with pytest.raises(CorruptError, match="expected"):
        decode_record(data + bytes(PAGE), 0, len(data) + PAGE)
    with pytest.raises(FormatError, match="bad magic"):
        decode_record(bytes(PAGE) + data, 0)


def test_float_payloads_stay_raw_and_views_are_zero_copy():
    record = sample_record()
    data = encode_record(record)
    assert not flags_of(data) & FLAG_ZSTD
    views = record_tensor_views(data, 0, len(data))
    for name, array in record.tensors.items():
        assert np.shares_memory(views[name], np.frombuffer(data, np.uint8))
        assert views[name].tobytes() == array.tobytes()


def test_compressible_payload_is_zstd_and_views_decompress():
    record = sample_record(compressible=True)
    data = encode_record(record)
    assert flags_of(data) & FLAG_ZSTD
    assert len(data) < sum(a.nbytes for a in record.tensors.values())
    views = record_tensor_views(data, 0, len(data))
    for name, array in record.tensors.items():
        assert views[name].tobytes() == array.tobytes()


def test_views_from_mmap_read_the_file(tmp_path):
    path = tmp_path / "000001.pack"
    append_record(path, sample_record("first"))
    offset, length = append_record(path, sample_record("second"))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        views = record_tensor_views(mm, offset, length)
        assert views["layers.3.diff.q.index"][1] == 7
        assert not views["layers.3.diff.q.index"].flags.writeable
        del views  # the views pin the mapping


def test_append_pads_a_torn_tail_and_scan_resyncs(tmp_path):
    path = tmp_path / "000001.pack"
    first = append_record(path, sample_record("first"))
    torn = encode_record(sample_record("torn"))
    with open(path, "ab") as f:
        f.write(torn[:PAGE + 100])  # a crash in the middle of an append
    third = append_record(path, sample_record("third"))
    assert third[0] == first[1] + 2 * PAGE
    found = list(scan(path))
    assert [item[:2] for item in found] == [first, (first[1], len(torn)), third]
    assert isinstance(found[1][2], CorruptError)
    assert f"offset {first[1]}" in str(found[1][2])
    assert [r.tenant for _, _, r in found if isinstance(r, PetRecord)] == ["first", "third"]


def test_scan_reports_damage_and_goes_on(tmp_path):
    path = tmp_path / "000001.pack"
    placed = [append_record(path, sample_record(name)) for name in ("a", "b", "c")]
    with open(path, "r+b") as f:
        f.seek(placed[1][0] + 2000)  # inside b's payload
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with open(path, "r+b") as f:
        f.seek(placed[2][0] + 8)  # c's header
        f.write(b"\xff")
    found = list(scan(path))
    assert [item[:2] for item in found] == [placed[0], placed[1], (placed[2][0], None)]
    assert isinstance(found[0][2], PetRecord)
    assert "payload checksum" in str(found[1][2])
    assert "header checksum" in str(found[2][2])


def test_scan_of_an_empty_file_yields_nothing(tmp_path):
    path = tmp_path / "000001.pack"
    path.touch()
    assert list(scan(path)) == []


def test_an_error_does_not_pin_the_mapping(tmp_path):
    """A damaged record read through `with mmap` must raise its own error, not BufferError."""
    path = tmp_path / "000001.pack"
    offset, length = append_record(path, sample_record())
    with open(path, "r+b") as f:
        f.seek(offset + length - 1)
        f.write(b"\x01")
    for read in (decode_record, record_tensor_views):
        with pytest.raises(CorruptError, match="padding"):
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                read(mm, offset, length)
