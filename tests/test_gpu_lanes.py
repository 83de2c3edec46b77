"""PetS Alg. 2 on CUDA streams (GpuExecutor(lanes=N)) under the CUDA-on-CPU emulation.

The emulation runs every launch at once, in call order, so equal results alone would not
show a missing stream dependency. The tracker below gives each stream a vector clock (a
launch ticks its stream; an event records its stream's clock; wait_event and synchronize
merge clocks) and records which device arrays every matmul and ops_gpu call reads and
writes: two accesses of one array, one a write, on different streams and not ordered by
the clocks, are a race a real GPU could run in either order. Properties: with lanes the
results equal one lane's and no access races; with waits dropped, the tracker finds races
(it can fail).
"""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from runtime.exec import ops_gpu
from runtime.exec.cpu import CpuExecutor
from runtime.exec.emu import cupy_standin
from runtime.exec.gpu import GpuExecutor
from tests.test_executor_cpu import pet_zoo, tiny_encoder
from tests.test_executor_gpu import emulated, random_batch


class Tracker:
    def __init__(self):
        self.local = threading.local()
        self.host: dict = {}
        self.accesses: dict = {}  # id(root array) -> [(mode, stream key, tick)]
        self.keep: list = []
        self.races: list = []
        self.launches: dict = {}
        self.honour_waits = True
        self.null = None

    def current(self):
        stack = getattr(self.local, "stack", None)
        return stack[-1] if stack else self.null

    @staticmethod
    def merge(into: dict, other: dict):
        for k, v in other.items():
            into[k] = max(into.get(k, 0), v)

    def launch(self, name, reads, writes, rows=None):
        """A kernel on the current stream reading and writing these arrays; rows (a set of
        row indices, or None for all) narrows the access of arrays that cover their memory."""
        s = self.current()
        self.merge(s.vc, self.host)
        s.vc[id(s)] = s.vc.get(id(s), 0) + 1
        self.launches[id(s)] = self.launches.get(id(s), 0) + 1
        for mode, arrays in (("r", reads), ("w", writes)):
            for a in arrays:
                root = a
                while isinstance(getattr(root, "base", None), np.ndarray):
                    root = root.base
                whole = a.ctypes.data == root.ctypes.data and a.nbytes == root.nbytes  # a view of all of it
                region = rows if whole else None
                self.keep.append(root)
                seen = self.accesses.setdefault(id(root), [])
                for m, key, tick, other in seen:
                    overlap = region is None or other is None or bool(region & other)
                    if key != id(s) and "w" in (m, mode) and overlap and s.vc.get(key, 0) < tick:
                        self.races.append((name, m, mode))
                seen.append((mode, id(s), s.vc[id(s)], region))


def tracked_cupy(tr: Tracker):
    class Stream(cupy_standin.Stream):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.vc = {}

        def __enter__(self):
            tr.local.stack = [*getattr(tr.local, "stack", []), self]
            return self

        def __exit__(self, *exc):
            tr.local.stack.pop()
            return False

        def wait_event(self, event):
            super().wait_event(event)
            if tr.honour_waits:
                tr.merge(self.vc, event.vc)

        def synchronize(self):
            tr.merge(tr.host, self.vc)

    class Event(cupy_standin.Event):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.vc = {}

        def record(self, stream=None):
            super().record(stream)
            self.vc = dict((stream or tr.current()).vc)

    tr.null = Stream()

    def matmul(a, b, *args, **kwargs):
        out = cupy_standin.matmul(a, b, *args, **kwargs)
        tr.launch("matmul", [a, b], [out])
        return out

    cuda = types.SimpleNamespace(**vars(cupy_standin.cuda))
    cuda.Stream, cuda.Event = Stream, Event
    fake = types.SimpleNamespace(**{k: v for k, v in vars(cupy_standin).items() if not k.startswith("__")})
    fake.cuda, fake.matmul = cuda, matmul
    return fake


# segmented edits touch only their active segments' rows of y (and x): where the segment table is
_SEGMENTS = {"bias_gather": 2, "sparse_add": 5, "sgmv": 4}


def _rows(name, args):
    if name in _SEGMENTS:
        j = _SEGMENTS[name]
        starts, ids = np.asarray(args[j]), np.asarray(args[j + 1])
        return {r for k in np.flatnonzero(ids >= 0) for r in range(int(starts[k]), int(starts[k + 1]))}
    if name == "bgmv":
        return set(np.flatnonzero(np.asarray(args[4]) >= 0).tolist())
    return None


class TrackedOps:
    """ops_gpu with every call recorded: array arguments read, the result (and out=) written;
    the segmented edits with the rows they touch."""

    def __init__(self, tr: Tracker):
        self.tr = tr

    def __getattr__(self, name):
        fn = getattr(ops_gpu, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            arrays = [a for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray)]
            written = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, np.ndarray)]
            if isinstance(kwargs.get("out"), np.ndarray):
                written.append(kwargs["out"])
            self.tr.launch(name, [a for a in arrays if not any(a is w for w in written)], written, _rows(name, args))
            return out

        return call


@pytest.fixture(scope="module")
def lanes_zoo(tmp_path_factory):
    enc = tiny_encoder(tmp_path_factory.mktemp("lanes"))
    return enc, pet_zoo(enc, 2)


def _run(enc, zoo, lanes, honour_waits=True):
    tr = Tracker()
    tr.honour_waits = honour_waits
    with ops_gpu.use_cupy(cupy_standin):
        ex = GpuExecutor(enc, _cupy=tracked_cupy(tr), _ops=TrackedOps(tr), lanes=lanes, hot_tier_rows=0,
                         max_batch=12, max_len=10)
        serving = [CpuExecutor(enc).load_pet(p, key=k) for k, p in enumerate(zoo)]
        rng = np.random.default_rng(3)
        assignment = rng.permutation(np.arange(12) % len(zoo)).tolist()
        inputs, mask = random_batch(enc, 12, 5, max_len=10)
        out = ex.run(inputs.numpy(), mask.numpy(), [serving[a] for a in assignment], keys=assignment)
        lane_launches = sum(tr.launches.get(id(s), 0) for s in ex.lane_streams)
    return out, tr, lane_launches


@emulated
def test_lanes_equal_one_lane_without_races(lanes_zoo):
    enc, zoo = lanes_zoo
    want, tr1, _ = _run(enc, zoo, lanes=1)
    got, tr3, lane_launches = _run(enc, zoo, lanes=3)
    assert lane_launches > 0  # the edits really ran on the lane streams
    assert tr1.races == [] and tr3.races == []
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@emulated
def test_tracker_finds_races_when_waits_are_dropped(lanes_zoo):
    enc, zoo = lanes_zoo
    _, tr, lane_launches = _run(enc, zoo, lanes=3, honour_waits=False)
    assert lane_launches > 0 and tr.races


def test_lanes_must_be_positive():
    with pytest.raises(ValueError, match="lanes"):
        GpuExecutor(None, lanes=0, _cupy=cupy_standin)
