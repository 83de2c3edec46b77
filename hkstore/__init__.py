"""hkstore: a versioned knowledge store for PLOT version trees and PET packs.

    st = hkstore.create(path, d=384, vocab_size=30522)     # or hkstore.open(path, writable=True)
    st.add_segment("root", keys, values)
    st.create_version("biology", parent="root")
    res = st.lookup("biology", windows)                    # values, served version, order
    st.put_pet(record); st.get_pet("tenant-a")
    hkstore.compact(st, "biology"); hkstore.verify(path); hkstore.gc(st)

Works without torch; only the construction commands of the CLI need the model.
"""

from formats.pack import PetRecord
from hkstore.branch import create_branch, select_by_frequency
from hkstore.compact import compact
from hkstore.diff import diff
from hkstore.errors import CorruptError, FormatError, StoreError, StoreLocked, UnknownTenant, UnknownVersion
from hkstore.lookup import LookupResult
from hkstore.maintenance import gc, verify
from hkstore.store import Snapshot, Store, create, model_meta
from hkstore.store import open_store as open

__all__ = [
    "CorruptError", "FormatError", "LookupResult", "PetRecord", "Snapshot", "Store", "StoreError", "StoreLocked",
    "UnknownTenant", "UnknownVersion", "compact", "create", "create_branch", "diff", "gc", "model_meta", "open",
    "select_by_frequency", "verify",
]
