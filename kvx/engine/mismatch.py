"""Why a request's KV bytes differ from what the model wrote, when the engine can tell."""

from __future__ import annotations

import torch


def likely_cause(
    got: torch.Tensor,
    want: torch.Tensor,
    first: int,
    block_size: int,
    recv_step: int | None,
    offset: int = 0,
) -> str:
    """A clause naming the likely cause of the first bad position `first` (`got` / `want`:
    one row of bytes per position, row 0 being position `offset`: a whole number of blocks),
    or "" when nothing points at one.

    - the row holds another position's KV: the connector wrote the wrong block;
    - the request was reported received (`finished_recving`) at `recv_step`: the load was
      reported finished before its bytes landed (or landed wrong)."""
    matches = (want == got[first]).all(dim=1).nonzero()
    if len(matches) and int(matches[0]) != first:
        other, first = int(matches[0]) + offset, first + offset
        return (
            f": it holds position {other}'s KV (the request's block {other // block_size}, "
            f"expected its block {first // block_size}): the connector wrote a wrong target block"
        )
    if recv_step is not None:
        return (
            f": the connector reported the request received (finished_recving) at step "
            f"{recv_step}; its bytes must have landed by then (a load reported finished "
            "before its bytes landed?)"
        )
    return ""
