"""The source's registry of pools registered with UCX for one-sided reads: per rank, the
pool's segments, one :class:`kvkern.xfer.ucp_rma.Region` per memory span, and whether the
segments are in the pool's own order (native) rather than canonical; per block manager that
offers one, its read directory (:mod:`kvkern.cache.directory`), registered so destinations
find and validate blocks without a message. Registered at start, released at close."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvkern.layout.segments import BlockSegments
from kvkern.xfer.kvgroup import RankKV

if TYPE_CHECKING:
    from types import ModuleType

    from kvkern.cache.directory import ReadDirectory
    from kvkern.xfer.kvgroup import KVGroup
    from kvkern.xfer.ucp_rma import Region

__all__ = ["RegionRegistry", "RegisteredDirectory", "RegisteredPool", "worker_address_hex"]

log = logging.getLogger("kvkern.xfer.source")

@dataclass(frozen=True)
class RegisteredDirectory:
    directory: ReadDirectory
    region: Region


@dataclass(frozen=True)
class RegisteredPool:
    segments: BlockSegments
    regions: list[Region]  # one per segment
    native: bool  # segments in the pool's own order: same-layout destinations, whole blocks
    directory: RegisteredDirectory | None = None  # the rank's block manager's, if published

    def read_index(self) -> dict:
        """What a destination needs to read this rank without a grant (the state document's
        ``read_index``; :func:`kvkern.xfer.state.parse_read_index` checks it)."""
        d = self.directory
        assert d is not None
        segs = self.segments
        return {"keys": [r.rkey.hex() for r in self.regions], "bases": list(segs.bases),
                "stride": segs.stride, "segment_bytes": segs.nbytes,
                "blocks": d.directory.num_blocks, "dir_key": d.region.rkey.hex(),
                "dir_base": d.directory.address, "dir_buckets": d.directory.buckets,
                "dir_group": d.directory.group, "dir_check": 1}


def worker_address_hex() -> str:
    """The worker address of the context this process's pools are registered in
    (:func:`kvkern.xfer.ucxcompat.read_target`), hex: what a destination's read lanes
    (:mod:`kvkern.xfer.read_lanes`) open their endpoints to. Empty if unavailable."""
    from kvkern.xfer import ucxcompat  # noqa: PLC0415

    try:
        return ucxcompat.read_target().address.hex()
    except Exception as exc:  # noqa: BLE001 (then no reads: destinations stream)
        log.warning("UCX read worker address unavailable, streaming only: %s", exc)
        return ""


class RegionRegistry:
    """rank -> :class:`RegisteredPool`; empty unless ``remote_read`` allows reads."""

    def __init__(self, remote_read: str) -> None:
        self.remote_read = remote_read
        self._pools: dict[int, RegisteredPool] = {}
        self._directories: list[Region] = []
        self.read_worker = ""  # hex of this process's UCX worker address (read lanes)
        self.read_local: dict | None = None  # local_reads.Beacon.doc(): same-host reads
        self._beacon = None  # (kept for the process's life: its bytes are read by address)

    def __bool__(self) -> bool:
        return bool(self._pools)

    def __contains__(self, rank: int) -> bool:
        return rank in self._pools

    def get(self, rank: int) -> RegisteredPool | None:
        return self._pools.get(rank)

    def register(self, ranks: Iterable[RankKV], groups: Iterable[KVGroup] = ()) -> None:
        """Register each rank's pool for remote reads where ``remote_read`` allows it: by
        canonical segments (:attr:`RankKV.read_segments`: block rows, or each layer of a
        per-layer HND pool; any destination and plan pieces), else by the pool's own
        segments (:attr:`RankKV.native_segments`: destinations of the same layout, whole
        blocks). A rank with neither is served by the stream (logged, not an error). Then
        the read directories of ``groups`` (:meth:`register_directories`)."""
        if self.remote_read == "off":
            return
        from kvkern.xfer import ucp_rma  # noqa: PLC0415

        why = ucp_rma.rma_unavailable()
        if why is not None:
            log.warning("remote reads unavailable, streaming only: %s", why)
            return
        for rank_kv in ranks:
            if rank_kv.device.type != "cpu" and self.remote_read != "all":
                continue
            segs, native = rank_kv.read_segments, False
            if segs is None:  # same-layout destinations may still read it, block for block
                segs, native = rank_kv.native_segments, True
            if segs is None:
                continue
            regions = self._regions_for(rank_kv, segs, ucp_rma)
            if regions is not None:
                self._pools[rank_kv.rank] = RegisteredPool(segs, regions, native)
        if self._pools:
            self.read_worker = worker_address_hex()
            from kvkern.xfer.local_reads import Beacon  # noqa: PLC0415

            self._beacon = Beacon()
            self.read_local = self._beacon.doc()
            self.register_directories(groups)

    def register_directories(self, groups: Iterable[KVGroup]) -> None:
        """Register the read directory of each group whose block manager offers one
        (``read_directory()``) and whose ranks' pools are registered; those ranks' state then
        carries a ``read_index``. A manager without one, or a failed registration, leaves
        its ranks read by grant only (logged)."""
        from kvkern.xfer import ucp_rma  # noqa: PLC0415

        for g in groups:
            ranks = [r for r in g.ranks if r in self._pools]
            make = getattr(g.manager, "read_directory", None)
            if not ranks or make is None:
                continue
            try:
                directory = make()
                region = ucp_rma.Region(directory.address, directory.nbytes)
            except (ucp_rma.RmaError, ValueError) as exc:
                log.warning("read directory of DP group %d not registered: %s", g.dp_rank, exc)
                continue
            self._directories.append(region)
            entry = RegisteredDirectory(directory, region)
            for r in ranks:
                self._pools[r] = dataclasses.replace(self._pools[r], directory=entry)

    @staticmethod
    def _regions_for(rank_kv: RankKV, segs: BlockSegments,
                     ucp_rma: ModuleType) -> list[Region] | None:
        mem = "host" if rank_kv.device.type == "cpu" else "cuda"
        made: dict[tuple[int, int], Region] = {}  # one region per span (K/V planes share)
        try:
            for span in segs.spans:
                if span not in made:
                    made[span] = ucp_rma.Region(*span, memory_type=mem)
        except (ucp_rma.RmaError, ValueError) as exc:
            log.warning("rank %d pool not registered for remote reads: %s", rank_kv.rank, exc)
            for region in made.values():
                region.close()
            return None
        return [made[span] for span in segs.spans]

    def close(self) -> None:
        """Deregister every pool (every connection is aborted first: nobody reads now)."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            for region in pool.regions:
                region.close()
        regions, self._directories = self._directories, []
        for region in regions:
            region.close()
