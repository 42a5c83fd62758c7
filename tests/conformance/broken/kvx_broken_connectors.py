"""Deliberately broken connectors: each wraps the good example connector and breaks one rule.

The conformance suite must fail each of them (tests/conformance/test_suite_has_teeth.py). The
faults are real misbehaviour of a real connector, not mocks of the suite.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from kvx_example_connector.connector import ExamplePDConnector
from kvx_example_connector.metadata import LoadSpec
from kvx_example_connector.worker import ExamplePDWorker

LEAKED_THREAD_STOPS: list[threading.Event] = []  # the test stops the leaked threads after it


class DropsBlockWorker(ExamplePDWorker):
    """Loads every block but the last one (whatever was there before stays)."""

    def _load(self, path: Path, load: LoadSpec, dim: int) -> None:
        last = torch.tensor(load.local_block_ids[-1:], dtype=torch.long)
        before = {name: cache.index_select(dim, last) for name, cache in self._caches.items()}
        super()._load(path, load, dim)
        for name, cache in self._caches.items():
            cache.index_copy_(dim, last, before[name])


class SwapsBlocksWorker(ExamplePDWorker):
    """Writes the first two loaded blocks into each other's place."""

    def _load(self, path: Path, load: LoadSpec, dim: int) -> None:
        local = list(load.local_block_ids)
        if len(local) > 1:
            local[0], local[1] = local[1], local[0]
        super()._load(
            path,
            LoadSpec(
                load.req_id,
                local,
                load.remote_engine_id,
                load.remote_request_id,
                load.remote_block_ids,
            ),
            dim,
        )


class FinishesEarlyWorker(ExamplePDWorker):
    """Reports a load finished as soon as it starts, before the data has landed."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, recving = super().get_finished(finished_req_ids)
        early = set(self._loading)
        self._loading.clear()  # forget them: the loads keep running unobserved
        return sending, recving | early


class NeverFreesWorker(ExamplePDWorker):
    """Holds a finished prompt's blocks and never reports them sent."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        _, recving = super().get_finished(finished_req_ids)
        return set(), recving


class WritesOtherHeadsWorker(ExamplePDWorker):
    """Loads the right blocks but puts each head's KV into the next head's place."""

    def _load(self, path: Path, load: LoadSpec, dim: int) -> None:
        super()._load(path, load, dim)
        index = torch.tensor(load.local_block_ids, dtype=torch.long)
        for cache in self._caches.values():
            blocks = cache.index_select(dim, index)
            cache.index_copy_(dim, index, blocks.roll(1, dims=-2))


class LeaksThreadWorker(ExamplePDWorker):
    """Starts a helper thread that outlives `shutdown()`."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        stop = threading.Event()
        LEAKED_THREAD_STOPS.append(stop)
        threading.Thread(target=stop.wait, name="leaked-by-connector", daemon=True).start()


class DropsBlock(ExamplePDConnector):
    worker_type = DropsBlockWorker


class SwapsBlocks(ExamplePDConnector):
    worker_type = SwapsBlocksWorker


class FinishesEarly(ExamplePDConnector):
    worker_type = FinishesEarlyWorker


class NeverFrees(ExamplePDConnector):
    worker_type = NeverFreesWorker


class WritesOtherHeads(ExamplePDConnector):
    worker_type = WritesOtherHeadsWorker


class LeaksThread(ExamplePDConnector):
    worker_type = LeaksThreadWorker
