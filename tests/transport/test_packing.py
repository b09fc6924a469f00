"""Packing outputs into shared memory and back: bit-exact, sized by what is sent, released once."""

from __future__ import annotations

import collections
import dataclasses
import enum
import multiprocessing
import pickle
from typing import Any, NamedTuple

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers.shm_children as children
from helpers.hypo import examples
from helpers.shm_fixtures import no_shm_leak, segment_pool
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput, OutputReady
from omni_async.transport.errors import (
    DeviceSyncUnavailable,
    LeaseAlreadyReleased,
    PoolClosed,
    PoolExhausted,
    UnsupportedOutputType,
)
from omni_async.transport.packing import (
    DEFAULT_INLINE_THRESHOLD,
    PackedPayload,
    is_packed,
    pack_diffusion_output_shm,
    packed_lease,
    packed_nbytes,
    release_packed_output,
    release_unpacked_output,
    unpack_diffusion_output_shm,
)
from omni_async.transport.platform import DeviceSync
from omni_async.transport.shm import SegmentPool, attach_view

__all__ = ["no_shm_leak", "segment_pool"]
SPAWN = multiprocessing.get_context("spawn")

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
] + [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]


def raw(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    rng = np.random.default_rng(seed)
    if dtype is torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n).astype(np.bool_)).reshape(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    data = np.frombuffer(rng.bytes(n * itemsize), dtype=np.uint8).copy()
    return torch.from_numpy(data).view(dtype).reshape(shape)


def out(value: Any, rid: str = "r") -> DiffusionOutput:
    return DiffusionOutput(rid, value, async_output_id=f"o-{rid}")


@settings(max_examples=examples(80), suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 33), min_size=0, max_size=3).map(tuple),
    layout=st.sampled_from(["contiguous", "transposed", "strided"]),
    to_shm=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_dtype_round_trips_bit_exactly(
    segment_pool: SegmentPool, dtype: torch.dtype, shape: tuple[int, ...], layout: str, to_shm: bool, seed: int
) -> None:
    base = random_bits(dtype, (*shape, 3) if layout == "strided" else shape, seed)
    if layout == "transposed" and base.dim() >= 2:
        t = base.transpose(0, -1)
    elif layout == "strided":
        t = base[..., ::2]
    else:
        t = base
    packed = pack_diffusion_output_shm(out({"t": t}), pool=segment_pool, inline_threshold=0 if to_shm else 1 << 20)
    wire = pickle.loads(pickle.dumps(packed))
    got = unpack_diffusion_output_shm(wire).output["t"]
    assert got.dtype == dtype and tuple(got.shape) == tuple(t.shape)
    assert raw(got) == raw(t)
    del got  # the last view: the segment goes back by itself (the fixture checks)


@pytest.mark.parametrize("to_shm", [False, True])
def test_nan_payloads_and_bf16_bits_survive(segment_pool: SegmentPool, to_shm: bool) -> None:
    f32 = (
        torch.tensor([0x7FC00001, 0xFFBADBAD, 0x7F800001, 0x00000001], dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )
    bf16 = torch.tensor([0x7FC1, 0xFF81, 0x0001, 0x8000], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    grid = f32.repeat(64, 1).t()  # non-contiguous after the transpose
    value = {"f32": f32, "bf16": bf16, "grid": grid}
    packed = pack_diffusion_output_shm(out(value), pool=segment_pool, inline_threshold=0 if to_shm else 1 << 20)
    got = unpack_diffusion_output_shm(packed, copy=True).output
    for k, v in value.items():
        assert got[k].dtype == v.dtype and raw(got[k]) == raw(v), k


def test_a_small_view_of_a_huge_tensor_costs_its_own_bytes(segment_pool: SegmentPool) -> None:
    """F5: a 2-element view of a 100 MB tensor packs 8 bytes, not its 100 MB storage."""
    huge = torch.empty(25_000_000, dtype=torch.float32)
    huge[10:12] = torch.tensor([1.5, -2.5])
    view = huge[10:12]
    inline = pack_diffusion_output_shm(out({"v": view}), pool=segment_pool)
    assert isinstance(inline.output, PackedPayload)
    assert inline.output.inline_bytes == 8 and inline.output.shm_bytes == 0 and inline.output.lease is None
    assert len(pickle.dumps(OutputReady("o-r", inline))) < 2000
    shm = pack_diffusion_output_shm(out({"v": view}), pool=segment_pool, inline_threshold=0)
    assert isinstance(shm.output, PackedPayload)
    assert shm.output.shm_bytes == 8 and shm.output.lease is not None and shm.output.lease.nbytes == 8
    assert len(pickle.dumps(shm)) < 2000
    assert unpack_diffusion_output_shm(shm).output["v"].tolist() == [1.5, -2.5]  # its views are gone: released
    assert segment_pool.stats().outstanding == 0
    arr = np.empty(25_000_000, dtype=np.float32)[5:7]
    packed = pack_diffusion_output_shm(out({"a": arr}), pool=segment_pool, inline_threshold=0)
    assert isinstance(packed.output, PackedPayload) and packed.output.shm_bytes == 8
    release_packed_output(packed)


class Color(enum.Enum):
    RED = 1


class Pair(NamedTuple):
    left: Any
    right: Any


@attrs.frozen
class Frame:
    image: torch.Tensor = attrs.field(validator=attrs.validators.instance_of(torch.Tensor))
    label: str = "x"
    extra: Any = None


@dataclasses.dataclass
class Video:
    frames: list[Frame]
    fps: float
    audio: np.ndarray[Any, Any] | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


def test_nested_structures_round_trip(segment_pool: SegmentPool) -> None:
    big = torch.randn(256, 256).to(torch.bfloat16)  # 128 KiB: shared memory
    value = {
        "video": Video(
            frames=[Frame(big, "a"), Frame(torch.arange(4), "b", extra=Pair(1, torch.ones(2)))],
            fps=24.0,
            audio=np.linspace(0, 1, 50_000, dtype=np.float32),
            meta={"seed": 7, "dtype": torch.bfloat16, "color": Color.RED, "size": torch.Size([2, 3])},
        ),
        "od": collections.OrderedDict([("z", 1), ("a", np.arange(3))]),
        "dd": collections.defaultdict(list, {"k": [1, 2]}),
        "tuple": (None, True, 3, 2.5, 1j, "s", b"small", bytearray(b"mutable"), frozenset({1, 2})),
        "blob": b"\x01" * 100_000,
        "mblob": bytearray(b"\x02" * 100_000),
        "np_scalar": np.float32(1.25),
    }
    packed = pack_diffusion_output_shm(out(value), pool=segment_pool)
    assert is_packed(packed) and packed.metrics["pack_shm_bytes"] > 0
    unpacked = unpack_diffusion_output_shm(pickle.loads(pickle.dumps(packed)))
    got = unpacked.output
    v = got["video"]
    assert type(v) is Video and type(v.frames[0]) is Frame and v.fps == 24.0
    assert raw(v.frames[0].image) == raw(big) and v.frames[0].label == "a"
    assert type(v.frames[1].extra) is Pair and torch.equal(v.frames[1].extra.right, torch.ones(2))
    src = value["video"]
    assert isinstance(src, Video) and v.audio is not None and src.audio is not None
    assert np.array_equal(v.audio, src.audio) and v.audio.dtype == np.float32
    assert v.meta == src.meta
    assert type(got["od"]) is collections.OrderedDict and list(got["od"]) == ["z", "a"]
    assert type(got["dd"]) is collections.defaultdict and got["dd"]["new"] == []
    assert got["tuple"] == value["tuple"] and type(got["tuple"][7]) is bytearray
    assert got["blob"] == value["blob"] and type(got["mblob"]) is bytearray and got["mblob"] == value["mblob"]
    assert got["np_scalar"] == np.float32(1.25)
    del got, v
    assert release_unpacked_output(unpacked) == 1


def test_unpack_is_zero_copy(segment_pool: SegmentPool) -> None:
    t = torch.arange(100_000, dtype=torch.int64)
    packed = pack_diffusion_output_shm(out({"t": t, "a": t.numpy() * 2}), pool=segment_pool)
    lease = packed_lease(packed)
    assert lease is not None
    seg = attach_view(lease.name, lease.size)
    got = unpack_diffusion_output_shm(packed).output
    lo, hi = seg.data_ptr(), seg.data_ptr() + lease.size
    assert lo <= got["t"].data_ptr() < hi
    assert lo <= got["a"].ctypes.data < hi
    assert torch.equal(got["t"], t) and np.array_equal(got["a"], t.numpy() * 2)
    copied = unpack_diffusion_output_shm(packed, copy=True).output  # copies
    assert not lo <= copied["t"].data_ptr() < hi and torch.equal(copied["t"], t)
    assert segment_pool.stats().outstanding == 1  # the zero-copy views still hold it
    del got
    assert segment_pool.outstanding() == []


def test_release_exactly_once(segment_pool: SegmentPool) -> None:
    payload = {"t": torch.ones(100_000)}
    packed = pack_diffusion_output_shm(out(payload), pool=segment_pool)
    assert release_packed_output(packed) == 1
    with pytest.raises(LeaseAlreadyReleased):
        release_packed_output(packed)
    packed = pack_diffusion_output_shm(out(payload), pool=segment_pool)
    unpacked = unpack_diffusion_output_shm(packed)
    assert release_unpacked_output(unpacked) == 1
    with pytest.raises(LeaseAlreadyReleased):
        release_unpacked_output(unpacked)
    with pytest.raises(LeaseAlreadyReleased):
        release_packed_output(packed)  # the same lease, through the other handle
    inline = pack_diffusion_output_shm(out({"t": torch.ones(3)}), pool=segment_pool)
    assert release_packed_output(inline) == 0
    assert release_unpacked_output(unpack_diffusion_output_shm(inline)) == 0
    assert release_packed_output(out({"plain": 1})) == 0


def test_release_after_the_pool_closed_is_a_typed_error(no_shm_leak: None) -> None:
    pool = SegmentPool(max_bytes=4 << 20)
    packed = pack_diffusion_output_shm(out({"t": torch.ones(100_000)}), pool=pool)
    pool.close()
    with pytest.raises(PoolClosed):
        release_packed_output(packed, pool=pool)


def test_zero_segment_creations_per_request_after_warmup(segment_pool: SegmentPool) -> None:
    for i in range(40):
        value = {"image": torch.full((512, 512), float(i)), "step": i, "latent": torch.randn(64, 64, 4)}
        packed = pack_diffusion_output_shm(out(value, rid=f"r{i}"), pool=segment_pool)
        got = unpack_diffusion_output_shm(pickle.loads(pickle.dumps(packed)))
        assert float(got.output["image"][0, 0]) == float(i)
        release_unpacked_output(got)
        if i == 0:
            warm = segment_pool.stats()
    stats = segment_pool.stats()
    assert warm.created == 1 and stats.created == 1
    assert stats.reused == 39 and stats.outstanding == 0


def test_the_packed_form_is_small(segment_pool: SegmentPool) -> None:
    value = {"a": torch.randn(1024, 1024), "b": torch.randn(1024, 1024).half(), "c": list(range(10))}
    packed = pack_diffusion_output_shm(out(value), pool=segment_pool)
    assert len(pickle.dumps(OutputReady("o-r", packed))) < 4096
    release_packed_output(packed)


def test_inline_total_is_bounded(segment_pool: SegmentPool) -> None:
    value = [torch.ones(12_800) for _ in range(100)]  # 100 x 50 KiB, each under the threshold
    packed = pack_diffusion_output_shm(out(value), pool=segment_pool, max_inline_bytes=1 << 20)
    assert isinstance(packed.output, PackedPayload)
    assert packed.output.inline_bytes <= 1 << 20 and packed.output.shm_bytes >= (100 - 20) * 51_200
    assert len(pickle.dumps(packed)) < (1 << 20) + 100_000
    got = unpack_diffusion_output_shm(packed, copy=True).output
    assert all(torch.equal(g, v) for g, v in zip(got, value, strict=True))


def test_unsupported_values_are_typed_errors_and_lease_nothing(segment_pool: SegmentPool) -> None:
    bad: list[tuple[Any, str]] = [
        ({"x": object()}, "output['x']"),
        ({"s": torch.eye(3).to_sparse()}, "output['s']"),
        ([np.array([object()], dtype=object)], "output[0]"),
        ({torch.ones(1): 1}, "key"),
        (Frame(torch.ones(1), extra={"deep": [lambda: 0]}), "output.extra['deep'][0]"),
    ]
    for value, where in bad:
        with pytest.raises(UnsupportedOutputType) as info:
            pack_diffusion_output_shm(out(value), pool=segment_pool)
        assert where in str(info.value)
    assert segment_pool.stats().leased == 0


# -- sizing: packed_nbytes, the worker's back-pressure number ----------------------------


def _copied(packed: DiffusionOutput) -> int:
    assert isinstance(packed.output, PackedPayload)
    return packed.output.shm_bytes + packed.output.inline_bytes


def _mixed_value() -> dict[str, Any]:
    huge = torch.zeros(1_000_000)
    return {
        "video": Video(
            frames=[Frame(torch.randn(64, 64), "a"), Frame(torch.arange(4), "b", extra=Pair(1, torch.ones(2)))],
            fps=24.0,
            audio=np.linspace(0, 1, 5_000, dtype=np.float32),
            meta={"seed": 7, "dtype": torch.bfloat16, "color": Color.RED},
        ),
        "view": huge[10:12],
        "strided": torch.ones(8, 8)[:, ::2],
        "array_view": np.zeros(1000, dtype=np.int16)[::10],
        "od": collections.OrderedDict([("z", 1), ("a", np.arange(3))]),
        "tuple": (None, 3, "s", b"small", bytearray(b"mutable"), memoryview(b"view")),
        "blob": b"\x01" * 100_000,
        "np_scalar": np.float32(1.25),
    }


@pytest.mark.parametrize("inline_threshold", [0, 1 << 10, DEFAULT_INLINE_THRESHOLD])
def test_packed_nbytes_is_what_packing_copies(segment_pool: SegmentPool, inline_threshold: int) -> None:
    """F5: the size the worker budgets is the bytes the packer copies, inline or in shared memory."""
    output = out(_mixed_value())
    packed = pack_diffusion_output_shm(output, pool=segment_pool, inline_threshold=inline_threshold)
    assert packed_nbytes(output) == _copied(packed)
    release_packed_output(packed)


def test_packed_nbytes_pins_the_packers_sizing() -> None:
    """Where the worker's former estimate disagreed with the packer, the packer's bytes win.

    Bytes-like leaves are copied (the estimate counted 0); a numpy scalar is a plain value
    in the skeleton (the estimate counted its itemsize); views cost their own bytes.
    """
    assert packed_nbytes(out({"b": b"abc", "ba": bytearray(5), "mv": memoryview(b"xy")})) == 3 + 5 + 2
    assert packed_nbytes(out({"s": np.float64(1.0), "i": 7, "t": "text", "none": None})) == 0
    huge = torch.zeros(1_000_000)
    views = {"v": huge[10:12], "strided": torch.ones(4, 4)[:, ::2], "a": np.zeros(100, np.float32)[::10]}
    assert packed_nbytes(out(views)) == 8 + 32 + 40
    nested = [Frame(torch.ones(3, dtype=torch.float64)), (torch.ones(2, dtype=torch.int8),), {"k": torch.ones(1)}]
    assert packed_nbytes(out(nested)) == 24 + 2 + 4
    assert packed_nbytes(out(None)) == 0


@settings(max_examples=examples(40), suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    tree=st.recursive(
        st.one_of(
            st.tuples(st.sampled_from(DTYPES), st.integers(0, 3000)).map(lambda p: torch.zeros(p[1], dtype=p[0])),
            st.integers(0, 3000).map(lambda n: np.zeros(n, dtype=np.int32)),
            st.binary(max_size=3000),
            st.integers(),
        ),
        lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=3), kids, max_size=4)),
        max_leaves=12,
    ),
    inline_threshold=st.sampled_from([0, 2048, DEFAULT_INLINE_THRESHOLD]),
)
def test_packed_nbytes_agrees_with_packing(segment_pool: SegmentPool, tree: Any, inline_threshold: int) -> None:
    output = out(tree)
    packed = pack_diffusion_output_shm(output, pool=segment_pool, inline_threshold=inline_threshold)
    assert packed_nbytes(output) == _copied(packed)
    release_packed_output(packed)


def test_packed_nbytes_refuses_what_the_packer_refuses() -> None:
    for value in (
        {"x": object()},
        {"s": torch.eye(3).to_sparse()},
        {torch.ones(1): 1},
        [torch.empty(2, device="meta")],
    ):
        with pytest.raises(UnsupportedOutputType):
            packed_nbytes(out(value))
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(UsageError):
        packed_nbytes(out(cyclic))
    with pytest.raises(UsageError):
        packed_nbytes(DiffusionOutput("r", PackedPayload((), None, 0, 0)))


def test_usage_errors(segment_pool: SegmentPool) -> None:
    packed = pack_diffusion_output_shm(out({"x": 1}), pool=segment_pool)
    with pytest.raises(UsageError):
        pack_diffusion_output_shm(packed, pool=segment_pool)
    with pytest.raises(UsageError):
        unpack_diffusion_output_shm(out({"x": 1}))
    with pytest.raises(UsageError):
        pack_diffusion_output_shm({"not": "an output"}, pool=segment_pool)  # type: ignore[arg-type]
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(UsageError):
        pack_diffusion_output_shm(out(cyclic), pool=segment_pool)


def test_an_unhonourable_sync_marker_fails_instead_of_racing(segment_pool: SegmentPool) -> None:
    """F1: a platform without events must synchronize; if it cannot, packing fails loudly."""
    marker = DeviceSync(torch.device("privateuseone"))
    with pytest.raises(DeviceSyncUnavailable):
        pack_diffusion_output_shm(out({"t": torch.ones(100_000)}), pool=segment_pool, ready_event=marker)
    assert segment_pool.stats().leased == 0


def test_an_exhausted_pool_is_a_typed_error(no_shm_leak: None) -> None:
    with SegmentPool(max_bytes=1 << 20, max_segments=1) as pool:
        held = pack_diffusion_output_shm(out({"t": torch.ones(1000, 100)}), pool=pool)
        with pytest.raises(PoolExhausted):
            pack_diffusion_output_shm(out({"t": torch.ones(1000, 100)}), pool=pool, lease_timeout=0.05)
        release_packed_output(held)
        assert pool.outstanding() == []


@pytest.mark.slow
def test_a_consumer_process_views_and_releases(segment_pool: SegmentPool) -> None:
    value = {
        f"{dtype}".replace("torch.", ""): random_bits(dtype, (257, 129), seed=i)
        for i, dtype in enumerate([torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int64, torch.bool])
    }
    packed = pack_diffusion_output_shm(out(value), pool=segment_pool, inline_threshold=0)
    recv, send = SPAWN.Pipe(duplex=False)
    p = SPAWN.Process(target=children.unpack_and_check, args=(segment_pool, send, packed))
    p.start()
    send.close()
    assert recv.poll(60)
    report = recv.recv()
    p.join(30)
    assert p.exitcode == 0
    for key, t in value.items():
        r = t.reshape(-1).view(torch.uint8)
        assert report[key] == (str(t.dtype), tuple(t.shape), int(r.to(torch.int64).sum()), r[:64].tolist()), key
    assert report["_released"] == 1
    assert segment_pool.outstanding() == []  # released by the other process
    with pytest.raises(LeaseAlreadyReleased):
        release_packed_output(packed)
