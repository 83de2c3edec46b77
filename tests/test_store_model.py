"""Model-based test: random put / branch / delete / compact / lookup sequences against a
plain-dict reference of FORMAT.md §4, served version and order included."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import hkstore

V, D, PAD = 5, 4, 0


def chain(window, kind):
    """The backoff chain, written straight from the spec's words."""
    n = len(window)
    lo = (n - 1) // 2 if kind == "centered" else n - 1
    offsets = [s - lo for s in range(n)]
    ranked = sorted(range(n), key=lambda s: (abs(offsets[s]), offsets[s] > 0))
    w = list(window)
    while True:
        yield tuple(w)
        drop = [s for s in ranked[1:] if w[s] != PAD]
        if not drop:
            return
        w[drop[-1]] = PAD


def order(key, kind):
    n = len(key)
    lo = (n - 1) // 2 if kind == "centered" else n - 1
    return 1 + sum(1 for s, t in enumerate(key) if s != lo and t != PAD)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = None

    @initialize(n=st.integers(2, 5), kind=st.sampled_from(["centered", "causal"]), seed=st.integers(0, 2**32 - 1))
    def setup(self, n, kind, seed):
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.n, self.kind = n, kind
        self.rng = np.random.default_rng(seed)
        self.store = hkstore.create(self.tmp.name + "/s", d=D, vocab_size=V, n=n, window=kind)
        lo = (n - 1) // 2 if kind == "centered" else n - 1
        uni = np.zeros((V, n), dtype=np.uint32)
        uni[:, lo] = np.arange(V)
        values = self.rng.standard_normal((V, n, D)).astype(np.float16)
        self.store.add_segment("root", uni, values)
        self.names = ["root"]
        self.parent = {"root": None}
        self.sealed = set()
        self.ref = {"root": {tuple(k): v for k, v in zip(uni.tolist(), values)}}

    def teardown(self):
        if self.tmp:
            self.store.close()
            self.tmp.cleanup()

    def random_keys(self, count):
        """Fresh keys mixed with keys already stored and their backoff keys, so that puts
        override, deletes hit and lookups back off onto entries that exist."""
        keys = self.rng.integers(0, V, (count, self.n)).astype(np.uint32)
        keys[:, (self.n - 1) // 2 if self.kind == "centered" else self.n - 1] = self.rng.integers(1, V, count)
        stored = [k for ver in self.names for k in self.ref[ver]]
        for i in range(count):
            if self.rng.random() < 0.5:
                keys[i] = stored[self.rng.integers(len(stored))]
            if self.rng.random() < 0.3:
                keys[i, self.rng.integers(self.n)] = self.rng.integers(1, V)
        return np.unique(keys, axis=0)

    def resolve_exact(self, version, key):
        while version is not None:
            if key in self.ref[version]:
                if self.ref[version][key] is not None:
                    return version, self.ref[version][key]
            version = self.parent[version]
        return None, None

    def writable(self):
        return [n for n in self.names[::-1] if n not in self.sealed]

    @precondition(lambda self: self.writable())
    @rule(data=st.data(), count=st.integers(1, 12), copy_parent=st.booleans())
    def put(self, data, count, copy_parent):
        version = data.draw(st.sampled_from(self.writable()))
        keys = self.random_keys(count)
        values = self.rng.standard_normal((len(keys), self.n, D)).astype(np.float16)
        if copy_parent and self.parent[version] is not None:
            # Entries equal to what the parent serves: compaction must drop exactly these.
            for i, k in enumerate(map(tuple, keys.tolist())):
                _, v = self.resolve_exact(self.parent[version], k)
                if v is not None:
                    values[i] = v
        self.store.add_segment(version, keys, values)
        for k, v in zip(map(tuple, keys.tolist()), values):
            self.ref[version][k] = v

    @rule(data=st.data())
    def branch(self, data):
        parent = data.draw(st.sampled_from(self.names[::-1]))
        name = f"b{len(self.names)}"
        self.store.create_version(name, parent)
        self.names.append(name)
        self.parent[name] = parent
        self.ref[name] = {}

    @precondition(lambda self: [n for n in self.writable() if n != "root"])
    @rule(data=st.data(), count=st.integers(1, 6))
    def delete(self, data, count):
        version = data.draw(st.sampled_from([n for n in self.writable() if n != "root"]))
        own = list(self.ref[version])
        keys = [own[i] for i in self.rng.permutation(len(own))[:count]] + [tuple(k) for k in self.random_keys(2).tolist()]
        self.store.delete(version, np.array(keys, dtype=np.uint32))
        for k in keys:
            self.ref[version][k] = None

    @rule(data=st.data())
    def seal(self, data):
        version = data.draw(st.sampled_from(self.names[::-1]))
        self.store.seal(version)
        self.sealed.add(version)
        with pytest.raises(hkstore.StoreError, match="sealed"):
            self.store.add_segment(version, self.random_keys(1), np.zeros((1, self.n, D)))

    def sealed_up_to(self, version, served):
        """Every version from `version` up to `served` is sealed: the answer cannot change."""
        while version is not None:
            if version not in self.sealed:
                return False
            if version == served:
                return True
            version = self.parent[version]
        return False

    @rule(data=st.data())
    def compact(self, data):
        version = data.draw(st.sampled_from(self.names[::-1]))
        hkstore.compact(self.store, version)
        own = self.ref[version]
        for k in list(own):
            if own[k] is None:
                del own[k]
            elif self.parent[version] is not None:
                # Parent-equal entries go only where the parent's answer can no longer change
                # (FORMAT.md section 2, Compaction); otherwise the branch keeps what it held.
                served, v = self.resolve_exact(self.parent[version], k)
                if v is not None and np.array_equal(v, own[k]) and self.sealed_up_to(self.parent[version], served):
                    del own[k]

    def check(self, version, windows):
        got = self.store.lookup(version, windows)
        for i, w in enumerate(map(tuple, windows.tolist())):
            for key in chain(w, self.kind):
                served, value = self.resolve_exact(version, key)
                if served is not None:
                    break
            assert got.version_names[got.version[i]] == served, (version, w, key)
            assert got.order[i] == order(key, self.kind)
            np.testing.assert_array_equal(got.values[i], value)

    @rule(data=st.data(), count=st.integers(1, 30))
    def lookup(self, data, count):
        self.check(data.draw(st.sampled_from(self.names[::-1])), self.random_keys(count))

    @invariant()
    def every_version_answers_like_the_reference(self):
        # After every step, every stored key (and a few fresh windows) at every version, as a
        # fresh reader sees the store: each committed change is visible and nothing else moved.
        if self.tmp is None:
            return
        reader = hkstore.open(self.store.path)
        assert reader.snapshot().manifest == self.store.snapshot().manifest
        stored = np.array(sorted({k for ver in self.names for k in self.ref[ver]}), dtype=np.uint32)
        windows = np.concatenate([stored, self.random_keys(8)])
        for version in self.names:
            self.check(version, windows)


StoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestStoreModel = StoreMachine.TestCase


def test_frequency_rule_covers_alpha_with_fewest_keys():
    keys = np.arange(10, dtype=np.uint32).reshape(-1, 1).repeat(3, axis=1)
    counts = np.array([50, 20, 10, 5, 5, 4, 3, 1, 1, 1])
    for alpha, expected in [(0, 0), (30, 1), (50, 1), (70, 2), (80, 3), (100, 10)]:
        kept, _ = hkstore.select_by_frequency(keys, counts, alpha)
        assert len(kept) == expected, alpha
    kept, _ = hkstore.select_by_frequency(keys, counts, 80)
    assert kept[:, 0].tolist() == [0, 1, 2]
    with pytest.raises(hkstore.StoreError):
        hkstore.select_by_frequency(keys, counts, 101)
