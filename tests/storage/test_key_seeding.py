"""Stored-block keys are seeded in one place, with the request's multimodal hashes, whichever
call first sees the request: a request scheduled without a lookup gets the same keys a looked
up one gets, and placeholder tokens of different images never share keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvx import NewRequestData, Request, SchedulerOutput
from kvx.plugins.storage.keys import block_keys, chain_seed
from kvx.plugins.storage.metadata import StorageMetadata

from .conftest import NAMESPACE

MakeRig = Callable[..., Any]  # conftest's Rig factory

TOKENS = [0] * 40  # an image's placeholder tokens: only the hashes tell two images apart


def stored_keys(meta: object) -> list[str]:
    assert isinstance(meta, StorageMetadata)
    return [key for store in meta.stores for key in store.keys]


@pytest.mark.parametrize("looked_up", [True, False])
def test_keys_are_seeded_with_multimodal_hashes_on_every_path(
    tmp_path: Path, make_rig: MakeRig, looked_up: bool
) -> None:
    rig = make_rig(f"file://{tmp_path}")
    saved: list[list[str]] = []
    for image in ("img-a", "img-b"):
        req_id = f"r-{image}"
        if looked_up:  # the usual path: the engine asks for a lookup first
            request = Request(req_id, list(TOKENS), mm_hashes=[image])
            rig.scheduler.on_new_request(request)
            rig.scheduler.get_num_new_matched_tokens(request, 0)
        blocks = rig.allocate(len(TOKENS))
        out = SchedulerOutput(num_scheduled_tokens={req_id: len(TOKENS)})
        out.scheduled_new_reqs.append(
            NewRequestData(req_id, list(TOKENS), (blocks,), 0, mm_hashes=[image])
        )
        saved.append(stored_keys(rig.scheduler.build_connector_meta(out)))
    for image, keys in zip(("img-a", "img-b"), saved, strict=True):
        assert keys == block_keys(TOKENS, 16, chain_seed(NAMESPACE, 16, [image]))[:2]
    assert not set(saved[0]) & set(saved[1])
