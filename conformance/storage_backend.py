"""The storage backend kit: pytest tests every `kvx.StorageBackend` must pass.

Subclass `StorageBackendTests` in a test module and give it a `backend` fixture that yields a
fresh backend (and closes it after):

    class TestMyBackend(StorageBackendTests):
        @pytest.fixture
        def backend(self, tmp_path): yield MyBackend(f"my://{tmp_path}", StorageBackendOptions())

Every test uses keys of its own, so backends that share state (one server, one process-wide
store) may be reused. See docs/writing-a-storage-backend.md.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

import kvx
from kvx import StorageBackend

VALUE = bytes(range(256)) * 40 + b"tail"  # 10244 bytes: no power of two, every byte value


class StorageBackendTests:
    """The kit. Not collected by itself (no `Test` prefix); subclasses are."""

    @pytest.fixture
    def backend(self) -> Iterator[StorageBackend]:
        pytest.fail(f"{type(self).__name__} must define a `backend` fixture")
        yield  # pragma: no cover

    @pytest.fixture
    def ns(self) -> str:
        """A key prefix no other test uses."""
        return f"kit-{uuid.uuid4().hex[:12]}"

    def test_is_a_storage_backend_with_its_url(self, backend: StorageBackend) -> None:
        assert isinstance(backend, StorageBackend)
        assert isinstance(backend.url, str) and backend.url
        assert backend.group_bytes >= 1

    def test_values_round_trip_and_absent_keys_read_as_none(
        self, backend: StorageBackend, ns: str
    ) -> None:
        keys = [f"{ns}/a", f"{ns}/b/c.l0-4.ab12.h0-2", f"{ns}/x"]
        backend.put_many([(keys[0], VALUE), (keys[1], memoryview(b"second"))])
        assert backend.get_many(keys, len(VALUE)) == [VALUE, b"second", None]
        assert backend.exists_many(keys) == [True, True, False]

    def test_empty_batches_do_nothing(self, backend: StorageBackend) -> None:
        backend.put_many([])
        backend.put_vectored([])
        assert backend.get_many([], 10) == []
        assert backend.exists_many([]) == []
        assert backend.get_into([], []) == []
        assert backend.get_vectored([], []) == []

    def test_a_put_replaces_the_whole_value(self, backend: StorageBackend, ns: str) -> None:
        backend.put_many([(f"{ns}/k", VALUE)])
        backend.put_many([(f"{ns}/k", b"short")])
        assert backend.get_many([f"{ns}/k"], len(VALUE)) == [b"short"]

    def test_a_value_longer_than_max_bytes_comes_back_whole_or_cut_after_one_more(
        self, backend: StorageBackend, ns: str
    ) -> None:
        backend.put_many([(f"{ns}/k", VALUE)])
        assert backend.get_many([f"{ns}/k"], 100)[0] in (VALUE, VALUE[:101])

    def test_get_into_fills_only_buffers_of_the_exact_size(
        self, backend: StorageBackend, ns: str
    ) -> None:
        backend.put_many([(f"{ns}/k", VALUE)])
        exact, short, absent = (bytearray(n) for n in (len(VALUE), len(VALUE) - 1, 8))
        views = [memoryview(b) for b in (exact, short, absent)]
        sizes = backend.get_into([f"{ns}/k", f"{ns}/k", f"{ns}/none"], views)
        assert sizes[0] == len(VALUE) and bytes(exact) == VALUE
        assert sizes[1] is not None and sizes[1] > len(short) and not any(short)
        assert sizes[2] is None and not any(absent)

    def test_vectored_values_are_the_concatenation_of_views_of_any_element_type(
        self, backend: StorageBackend, ns: str
    ) -> None:
        src = torch.arange(3000, dtype=torch.float32)
        parts = [src[:1].numpy().data, src[1:1000].numpy().data, src[1000:].numpy().data]
        backend.put_vectored([(f"{ns}/k", [b"head", *parts])])
        dst, head = torch.zeros(3000, dtype=torch.float32), bytearray(4)
        into = [memoryview(head), dst[:2000].numpy().data, dst[2000:].numpy().data]
        assert backend.get_vectored([f"{ns}/k"], [into]) == [4 + 4 * 3000]  # bytes
        assert head == b"head" and torch.equal(dst, src)

    def test_vectored_reads_leave_buffers_of_another_total_untouched(
        self, backend: StorageBackend, ns: str
    ) -> None:
        backend.put_vectored([(f"{ns}/k", [VALUE[:10], VALUE[10:]])])
        longer = [memoryview(bytearray(10)), memoryview(bytearray(len(VALUE)))]
        shorter = [memoryview(bytearray(len(VALUE) - 1))]
        sizes = backend.get_vectored([f"{ns}/k", f"{ns}/k", f"{ns}/none"], [longer, shorter, []])
        assert sizes[0] == len(VALUE) and not any(any(b) for b in longer)
        assert sizes[1] is not None and sizes[1] > len(VALUE) - 1 and not any(shorter[0])
        assert sizes[2] is None

    def test_vectored_reads_need_one_buffer_list_per_key(
        self, backend: StorageBackend, ns: str
    ) -> None:
        with pytest.raises(ValueError):
            backend.get_vectored([f"{ns}/a", f"{ns}/b"], [[memoryview(bytearray(1))]])

    @pytest.mark.timeout(60)
    def test_readers_never_see_a_torn_value_while_threads_write(
        self, backend: StorageBackend, ns: str
    ) -> None:
        values = [bytes([i]) * (256 << 10) for i in range(1, 6)]
        keys = [f"{ns}/k{i}" for i in range(3)]
        backend.put_many([(key, values[0]) for key in keys])
        seen: list[bytes | None] = []
        errors: list[BaseException] = []

        def write(key: str) -> None:
            try:
                for value in values[1:]:
                    backend.put_vectored([(key, [value[:1000], value[1000:]])])
            except BaseException as exc:  # reported by the test, not lost in the thread
                errors.append(exc)

        writers = [threading.Thread(target=write, args=(key,)) for key in keys]
        for thread in writers:
            thread.start()
        while any(t.is_alive() for t in writers):
            seen.extend(backend.get_many(keys, len(values[0])))
        for thread in writers:
            thread.join()
        assert not errors, errors
        assert set(seen) <= set(values), "a reader saw a torn or foreign value"
        assert backend.get_many(keys, len(values[0])) == [values[-1]] * len(keys)

    def test_hashed_block_io_round_trips(self, backend: StorageBackend, ns: str) -> None:
        """Whole blocks with their checksums: through the backend's own calls where it
        declares `kvx.SupportsHashedIO`, else through that mixin's defaults on its vectored
        calls (what a backend gets by declaring it)."""
        blocks = torch.arange(4 * 512, dtype=torch.uint8).reshape(4, 512)
        region = blocks.numpy().data.cast("B")
        table = [(region, 0, 200, 512), (region, 200, 312, 512)]  # each block in two regions
        prefix = b"P" * 24
        keys = [f"{ns}/a", f"{ns}/b"]
        if isinstance(backend, kvx.SupportsHashedIO):
            hashed: Any = backend
        else:
            assert not hasattr(backend, "put_blocks_hashed"), "declare kvx.SupportsHashedIO"
            hashed = _Defaults(backend)
        hashed.put_blocks_hashed(keys, [k.encode() + prefix for k in keys], prefix, table, [3, 1])
        out = torch.zeros_like(blocks)
        out_region = out.numpy().data.cast("B")
        out_table = [(out_region, 0, 200, 512), (out_region, 200, 312, 512)]
        heads = [memoryview(bytearray(32)) for _ in keys]
        skip = (len(prefix), len(prefix) + 8)
        read = hashed.get_blocks_hashed(
            keys, [k.encode() for k in keys], skip, heads, out_table, [0, 2]
        )
        for head, (size, digest) in zip(heads, read, strict=True):
            assert size == 32 + 512 and bytes(head[:24]) == prefix
            assert digest == int.from_bytes(head[24:], "little")  # the checksum it stored
        assert torch.equal(out[0], blocks[3]) and torch.equal(out[2], blocks[1])
        assert not out[1].any() and not out[3].any()

    def test_listing_and_deleting_where_declared(self, backend: StorageBackend, ns: str) -> None:
        """`kvx.SupportsListing` (what `kvx store` needs): keys by prefix with their sizes and
        write times, and deletes that touch nothing else. Skipped where not declared."""
        if not kvx.supports_listing(backend):
            pytest.skip(f"{type(backend).__name__} does not declare kvx.SupportsListing")
        lister: Any = backend
        values = {f"{ns}/a/1": VALUE, f"{ns}/a/2.l0-4.h0-2": b"two", f"{ns}/ab": b"three"}
        backend.put_many(list(values.items()))
        started = time.time()
        listed = {e.key: e for e in lister.list_keys(f"{ns}/")}
        assert {k: e.size for k, e in listed.items()} == {k: len(v) for k, v in values.items()}
        for entry in listed.values():
            assert entry.modified is None or abs(entry.modified - started) < 300
        assert sorted(e.key for e in lister.list_keys(f"{ns}/a/")) == sorted(values)[:2]
        assert list(lister.list_keys(f"{ns}-absent/")) == []
        assert lister.delete_many([f"{ns}/a/1", f"{ns}/absent"]) == 1
        assert backend.exists_many(sorted(values)) == [False, True, True]
        assert backend.get_many(sorted(values)[1:], len(VALUE)) == [b"two", b"three"]


class _Defaults(kvx.SupportsHashedIO, StorageBackend):
    """A backend's plain calls with `kvx.SupportsHashedIO`'s defaults on top (the kit's view
    of a backend that does not declare the ability)."""

    def __init__(self, inner: StorageBackend) -> None:
        self.url, self.inner = inner.url, inner

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        self.inner.put_many(items)

    def put_vectored(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
        self.inner.put_vectored(items)

    def get_many(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        return self.inner.get_many(keys, max_bytes)

    def get_vectored(
        self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        return self.inner.get_vectored(keys, buffers)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists_many(keys)

    def close(self) -> None:
        """The kit closes the backend itself."""
