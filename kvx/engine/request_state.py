"""`RequestState`: the reference scheduler's bookkeeping of one request (its own module so the
scheduler's helpers can name it without importing the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvx.contract.types import Request


@dataclass
class RequestState:
    """Scheduler bookkeeping of one request."""

    request: Request
    blocks: list[int] = field(default_factory=list)
    ever_scheduled: bool = False
    sync_loaded_tokens: int = 0  # tokens loaded synchronously in the current step
    loaded: bool = False  # promoted after a remote load, not yet scheduled
    kv_transfer_params_out: dict[str, Any] | None = None
    finished_step: int = -1  # the scheduler step in which the request finished
    window_skipped: int = 0  # two KV-cache groups: the window group's leading null entries
    asked_later: bool = False  # get_num_new_matched_tokens last answered None
    # Finished normally and freed at once: its table, whose bytes stay untouched until the
    # next step allocates (`Engine.check_kv` checks them until then).
    freed_blocks: list[int] = field(default_factory=list)
