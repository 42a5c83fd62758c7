"""The rank grid: which global ranks form each TP, PP, DP, PCP, DCP and EP group.

World ranks are laid out as `[ExternalDP, DP, PP, PCP, TP]` with TP varying fastest. A group
kind takes its axis to the end (swapping it with TP) and cuts the flattened ranks into groups
of that axis' size. Memberships match vLLM's `initialize_model_parallel`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvx.topology.errors import TopologyError

GROUP_KINDS = ("world", "tp", "dcp", "pcp", "pp", "dp", "ep")
_AXES = ("external_dp", "dp", "pp", "pcp", "tp")


@dataclass(frozen=True)
class RankCoords:
    """A world rank's position on the grid."""

    external_dp: int
    dp: int
    pp: int
    pcp: int
    tp: int


@dataclass(frozen=True)
class RankGrid:
    """Group memberships of a world of `world_size` ranks.

    `dcp_size` subdivides each TP group into consecutive ranks (vLLM's legacy DCP groups,
    needs `tp_size % dcp_size == 0`); with `dcp_across_pcp` DCP groups span PCP first and then
    TP, as vLLM 0.33 builds them (needs `(pcp_size * tp_size) % dcp_size == 0`). The EP group
    (MoE models) holds every rank of one PP stage across DP, PCP and TP.
    """

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    dcp_across_pcp: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "dp_size", "pcp_size", "dcp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"RankGrid.{name} must be an int >= 1, got {value!r}")
        inner = self.dp_size * self.pp_size * self.pcp_size * self.tp_size
        if self.world_size % inner:
            raise TopologyError(
                f"RankGrid.world_size={self.world_size} is not a multiple of dp*pp*pcp*tp = "
                f"{self.dp_size}*{self.pp_size}*{self.pcp_size}*{self.tp_size} = {inner}; use "
                f"a world size of {inner} times the number of external DP replicas"
            )
        span = self.pcp_size * self.tp_size if self.dcp_across_pcp else self.tp_size
        if span % self.dcp_size:
            what = "pcp_size*tp_size" if self.dcp_across_pcp else "tp_size"
            raise TopologyError(
                f"RankGrid.dcp_size={self.dcp_size} must divide {what}={span}: DCP reuses the "
                "ranks of a TP group rather than adding ranks"
            )

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """`(external_dp, dp, pp, pcp, tp)` sizes."""
        inner = self.dp_size * self.pp_size * self.pcp_size * self.tp_size
        return (self.world_size // inner, self.dp_size, self.pp_size, self.pcp_size, self.tp_size)

    def coords(self, rank: int) -> RankCoords:
        """Where `rank` sits on the grid."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        out = []
        for size in reversed(self.shape):
            rank, index = divmod(rank, size)
            out.append(index)
        return RankCoords(*reversed(out))

    def rank_of(self, coords: RankCoords) -> int:
        """The world rank at `coords`."""
        rank = 0
        for axis, size in zip(_AXES, self.shape):
            rank = rank * size + getattr(coords, axis)
        return rank

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of `kind` (one of `GROUP_KINDS`), in vLLM's order."""
        _, dp, pp, pcp, tp = self.shape
        if kind == "world":
            return [list(range(self.world_size))]
        if kind == "tp":
            return self._cut((0, 1, 2, 3, 4), tp)
        if kind == "dcp":
            order = (0, 1, 2, 4, 3) if self.dcp_across_pcp else (0, 1, 2, 3, 4)
            return self._cut(order, self.dcp_size)
        if kind == "pcp":
            return self._cut((0, 1, 2, 4, 3), pcp)
        if kind == "pp":
            return self._cut((0, 1, 4, 3, 2), pp)
        if kind == "dp":
            return self._cut((0, 4, 2, 3, 1), dp)
        if kind == "ep":
            return self._cut((0, 2, 1, 3, 4), dp * pcp * tp)
        raise TopologyError(f"group kind must be one of {list(GROUP_KINDS)}, got {kind!r}")

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of `kind` that holds `rank`."""
        self.coords(rank)
        return next(g for g in self.groups(kind) if rank in g)

    def _cut(self, order: tuple[int, ...], size: int) -> list[list[int]]:
        """Transpose the grid to axis `order`, flatten, cut into groups of `size`."""
        shape = self.shape
        flat = []
        for index in itertools.product(*(range(shape[a]) for a in order)):
            coords = [0] * 5
            for axis, i in zip(order, index):
                coords[axis] = i
            flat.append(self.rank_of(RankCoords(*coords)))
        return [flat[i : i + size] for i in range(0, len(flat), size)]
