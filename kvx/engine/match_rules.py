"""The contract rules on `get_num_new_matched_tokens`'s answer (docs/contract.md): each breach
is recorded with the rule's name and the values, then the engine goes on with the nearest
valid answer, never repairing one silently. vLLM asserts on every one of them."""

from __future__ import annotations

from kvx.contract.types import Request


def checked_match(
    kv_role: str | None, req: Request, n_local: int, n_ext: int, load_async: bool
) -> tuple[int, bool, list[str]]:
    """The count and async flag to go on with for `req` (with `n_local` tokens hit locally),
    and a violation message per rule the connector's answer `(n_ext, load_async)` broke."""
    req_id, total = req.request_id, req.num_tokens
    problems = []
    if n_ext and kv_role == "kv_producer":
        problems.append(
            f"role kv_producer: get_num_new_matched_tokens offered {n_ext} tokens to load for "
            f"request {req_id}; a pure producer never loads"
        )
    if n_ext < 0 or n_local + n_ext > total:
        problems.append(
            f"rule matched-tokens-in-range: get_num_new_matched_tokens offered {n_ext} tokens "
            f"for request {req_id} with {n_local} of its {total} tokens computed locally; the "
            f"count must be from 0 to {total - n_local} (vLLM asserts local + external <= the "
            "request's tokens)"
        )
        n_ext = min(max(n_ext, 0), total - n_local)
    if load_async and n_ext == 0:
        problems.append(
            f"rule async-load-has-tokens: get_num_new_matched_tokens answered (0, True) for "
            f"request {req_id}; an asynchronous load of nothing never finishes (vLLM asserts "
            "the count is > 0 when the load is asynchronous): answer (0, False)"
        )
        load_async = False
    if not load_async and n_ext and n_local + n_ext >= total:
        problems.append(
            f"rule one-token-computed: get_num_new_matched_tokens offered {n_ext} tokens to "
            f"load for request {req_id} with {n_local} of its {total} tokens computed "
            f"locally: offered all {total} prompt tokens; at least one must be computed "
            "(vLLM asserts on this)"
        )
        n_ext = max(0, total - 1 - n_local)
    return n_ext, load_async, problems
