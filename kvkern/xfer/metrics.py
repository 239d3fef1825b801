"""Prometheus metrics of the pull path, one registry per :class:`XferMetrics` instance.

Every metric is prefixed ``kvkern_``. Destination side (the puller calls these)::

    kvkern_hints_received_total                      counter
    kvkern_hints_accepted_total                      counter
    kvkern_hints_ignored_total{reason}               counter   hint led to no pull attempt
    kvkern_metadata_fetch_failures_total{reason}     counter   GET state failed / timed out
    kvkern_transfer_failures_total{reason}           counter   pull failed after the fetch
    kvkern_fallbacks_total{reason}                   counter   request ran without the pull
    kvkern_pulls_total{outcome}                      counter   one per finished pull
    kvkern_blocks_transferred_total                  counter   blocks received and committed
    kvkern_bytes_transferred_total                   counter   bytes received
    kvkern_blocks_skipped_total                      counter   blocks the destination had already
    kvkern_direct_reads_total{result}                counter   pairs read without a message
    kvkern_pairs_pulled_total{path}                  counter   direct, read or stream
    kvkern_local_read_refusals_total                 counter   same-host sources this process
                                                               may not read itself (process-wide)
    kvkern_reads_past_drain_total{memory}            counter   aborted reads still running after
                                                               their drain (private: quarantined,
                                                               engine: waited for; process-wide)
    kvkern_blocks_quarantined_total                  counter   private blocks held out of reuse:
                                                               reads into them outlived their abort
    kvkern_blocks_quarantine_freed_total             counter   ... freed once those reads ended
    kvkern_pulls_in_flight                           gauge
    kvkern_phase_seconds{phase}                      histogram metadata, plan, allocate,
                                                               transfer, unpack, validate,
                                                               commit, total

Source side (:class:`kvkern.xfer.source.SourceService`)::

    kvkern_source_requests_total{status}             counter   one per PullRequest answered
                                                               (ok partial miss rejected busy
                                                               error)
    kvkern_source_blocks_served_total                counter   blocks whose bytes were all sent
    kvkern_source_bytes_sent_total                   counter
    kvkern_source_send_failures_total{reason}        counter   sends that did not complete
    kvkern_source_pinned_blocks                      gauge     blocks pinned by running sends
                                                               (a block two sends pin counts 2)
    kvkern_source_sends_in_flight                    gauge
    kvkern_source_send_seconds                       histogram pin -> last chunk sent
    kvkern_source_pack_seconds                       histogram one chunk packed into staging
                                                               (a stream chunk that is not one
                                                               run of a host row pool)
    kvkern_source_packed_bytes_total                 counter   bytes packed into staging
    kvkern_source_connections_refused_total{reason}  counter   UCX connections turned away
                                                               before they were served
                                                               (address_not_accepted
                                                               address_not_proven
                                                               handshake unauthenticated
                                                               untrusted_limit
                                                               connection_limit)
    kvkern_source_http_refused_total{reason}         counter   HTTP requests and connections
                                                               the source turned away
                                                               (unauthenticated
                                                               connection_limit header_timeout
                                                               body_timeout body_refused)
    kvkern_source_connections                        gauge     authenticated connections
                                                               being served
    kvkern_source_connections_closed_total{reason}   counter   served connections the source
                                                               closed (idle
                                                               too_many_requests)

Histogram buckets run from 100 us to 60 s. Label values (reasons, outcomes) must be short
identifiers (``[a-z0-9_]``, at most 64 characters) so an exception text can never explode the
label cardinality; anything else raises ``ValueError``. Phases must be one of :data:`PHASES`.

``prometheus_client`` is imported here only; ``import kvkern`` does not load it.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

__all__ = ["CONTENT_TYPE_LATEST", "LATENCY_BUCKETS", "PHASES", "XferMetrics"]

PREFIX = "kvkern_"
PHASES: tuple[str, ...] = ("metadata", "plan", "allocate", "transfer", "unpack", "validate",
                           "commit", "total")
LATENCY_BUCKETS: tuple[float, ...] = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0,
)
SOURCE_STATUSES: tuple[str, ...] = ("ok", "partial", "miss", "rejected", "busy", "error")
DIRECT_READ_RESULTS: tuple[str, ...] = ("used", "missing", "changed", "failed")
PAIR_PATHS: tuple[str, ...] = ("direct", "read", "stream")
CONNECTION_REFUSALS: tuple[str, ...] = ("address_not_accepted", "address_not_proven",
                                        "handshake", "unauthenticated", "untrusted_limit",
                                        "connection_limit")
CONNECTION_CLOSES: tuple[str, ...] = ("idle", "too_many_requests")
_LABEL_RE = re.compile(r"[a-z0-9_]{1,64}")


def _label(kind: str, value: str) -> str:
    v = getattr(value, "value", value)  # str enums (Status) pass as their value
    if not isinstance(v, str) or not _LABEL_RE.fullmatch(v):
        raise ValueError(f"{kind} {value!r} is not a metric label ([a-z0-9_], 1-64 chars)")
    return v


def _count(name: str, n: int | float) -> float:
    if n < 0:
        raise ValueError(f"{name} increment {n} is negative")
    return n


class _LocalReadRefusals:
    """``kvkern_local_read_refusals_total``: checks of a same-host source that found this
    process may not read it with its own calls (:func:`kvkern.xfer.local_reads.usable`: the
    host's ptrace policy, a process gone, a token that differs), counted process-wide. Such a
    source is read through UCX instead."""

    NAME = PREFIX + "local_read_refusals"
    DOC = "Same-host sources found not readable with this process's own calls (process-wide)."

    def collect(self) -> Iterator[CounterMetricFamily]:
        from kvkern.xfer import local_reads  # noqa: PLC0415

        yield CounterMetricFamily(self.NAME, self.DOC, value=local_reads.refusals())

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.NAME, self.DOC)


class _ReadsPastDrain:
    """``kvkern_reads_past_drain_total{memory}``: read lanes' drains whose reads were still
    running ``READ_DRAIN_S`` after their endpoint's forced close
    (:func:`kvkern.xfer.read_lanes.reads_past_drain`), counted process-wide: into the puller's
    own blocks (``private``: quarantined) or an engine's (``engine``: the pull, and the
    engine's blocks, waited until they ended)."""

    NAME = PREFIX + "reads_past_drain"
    DOC = ("Aborted one-sided reads still running after their drain, by the memory they "
           "write (process-wide).")

    def collect(self) -> Iterator[CounterMetricFamily]:
        from kvkern.xfer import read_lanes  # noqa: PLC0415

        family = CounterMetricFamily(self.NAME, self.DOC, labels=("memory",))
        for memory, n in read_lanes.reads_past_drain().items():
            family.add_metric((memory,), n)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.NAME, self.DOC, labels=("memory",))


class _LaneSetSpills:
    """``kvkern_read_lane_spills_total``: read scripts that ran on a spare lane set because
    every set before it was running reads past their due time
    (:func:`kvkern.xfer.read_lanes.lane_set_spills`), counted process-wide."""

    NAME = PREFIX + "read_lane_spills"
    DOC = ("Pulls whose reads ran on a spare read lane set, the sets before it each busy past "
           "its due time (process-wide).")

    def collect(self) -> Iterator[CounterMetricFamily]:
        from kvkern.xfer import read_lanes  # noqa: PLC0415

        yield CounterMetricFamily(self.NAME, self.DOC, value=read_lanes.lane_set_spills())

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.NAME, self.DOC)


HTTP_REFUSALS = ("unauthenticated", "connection_limit", "header_timeout", "body_timeout",
                 "body_refused")


class _HttpRefusals:
    """``kvkern_source_http_refused_total{reason}``: requests and connections a source's HTTP
    server turned away, read at each scrape from the counters of whatever
    :meth:`XferMetrics.watch_http` was given (:data:`HTTP_REFUSALS`: a peer path without
    a valid credential, a connection past the connection limits, no complete request head in
    time, a body that came too slowly, one too large or sent where none is read)."""

    NAME = PREFIX + "source_http_refused"
    DOC = "HTTP requests and connections the source turned away, by reason."

    def __init__(self) -> None:
        self.sources: list[Callable[[], dict[str, int]]] = []

    def collect(self) -> Iterator[CounterMetricFamily]:
        totals = dict.fromkeys(HTTP_REFUSALS, 0)
        for source in list(self.sources):
            for reason, n in source().items():
                totals[reason] += n
        family = CounterMetricFamily(self.NAME, self.DOC, labels=("reason",))
        for reason, n in totals.items():
            family.add_metric((reason,), n)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.NAME, self.DOC, labels=("reason",))


class XferMetrics:
    """Every ``kvkern_`` metric, registered in ``registry`` (a fresh
    :class:`~prometheus_client.CollectorRegistry` by default, so tests can create many).
    Thread-safe (prometheus_client metrics are)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(p + name, doc, labels, registry=r)

        # destination
        self.hints_received = counter("hints_received", "Hints received with a request.")
        self.hints_accepted = counter("hints_accepted", "Hints that led to a pull attempt.")
        self.hints_ignored = counter("hints_ignored", "Hints that led to no pull, by reason.",
                                     ("reason",))
        self.metadata_fetch_failures = counter(
            "metadata_fetch_failures", "Source state fetches that failed, by reason.",
            ("reason",))
        self.transfer_failures = counter("transfer_failures",
                                         "Pulls that failed after the fetch, by reason.",
                                         ("reason",))
        self.fallbacks = counter("fallbacks", "Hinted requests that ran without the pulled "
                                 "blocks, by reason.", ("reason",))
        self.pulls = counter("pulls", "Finished pulls, by outcome.", ("outcome",))
        self.blocks_transferred = counter("blocks_transferred",
                                          "Blocks received and committed.")
        self.bytes_transferred = counter("bytes_transferred", "KV bytes received.")
        self.blocks_skipped = counter("blocks_skipped", "Hinted blocks the destination "
                                      "already held (not transferred).")
        self.direct_reads = counter("direct_reads", "Pairs read without a message to the "
                                    "source, by result (used; else a grant was asked for).",
                                    ("result",))
        self.pairs_pulled = counter("pairs_pulled", "Pairs (source rank, destination rank) "
                                    "whose bytes arrived, by path: direct (read without a "
                                    "message), read (granted one-sided read), stream.",
                                    ("path",))
        r.register(_LocalReadRefusals())
        r.register(_ReadsPastDrain())
        r.register(_LaneSetSpills())
        self._http_refusals = _HttpRefusals()
        r.register(self._http_refusals)
        self.blocks_quarantined = counter("blocks_quarantined", "Private blocks held out "
                                          "of reuse: one-sided reads into them outlived their "
                                          "abort.")
        self.blocks_quarantine_freed = counter("blocks_quarantine_freed", "Quarantined "
                                               "blocks freed once every read into them "
                                               "ended.")
        self.pulls_in_flight = Gauge(p + "pulls_in_flight", "Pulls in progress.", registry=r)
        self.phase_seconds = Histogram(p + "phase_seconds", "Latency of each pull phase.",
                                       ("phase",), buckets=LATENCY_BUCKETS, registry=r)
        # source
        self.source_requests = counter("source_requests",
                                       "Pull requests answered by the source, by status.",
                                       ("status",))
        self.source_blocks_served = counter("source_blocks_served",
                                            "Blocks whose bytes the source sent completely.")
        self.source_bytes_sent = counter("source_bytes_sent", "KV bytes the source sent.")
        self.source_send_failures = counter("source_send_failures",
                                            "Source sends that did not complete, by reason.",
                                            ("reason",))
        self.source_pinned_blocks = Gauge(p + "source_pinned_blocks",
                                          "Blocks pinned by running source sends (counted per send).",
                                          registry=r)
        self.source_sends_in_flight = Gauge(p + "source_sends_in_flight",
                                            "Source sends in progress.", registry=r)
        self.source_connections_refused = counter(
            "source_connections_refused", "UCX connections turned away before they were "
            "served, by reason.", ("reason",))
        self.source_connections = Gauge(p + "source_connections", "Authenticated "
                                        "connections being served.", registry=r)
        self.source_connections_closed = counter(
            "source_connections_closed", "Served connections the source closed, by reason.",
            ("reason",))
        self.source_send_seconds = Histogram(p + "source_send_seconds",
                                             "Source send latency (pin to last chunk).",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.source_pack_seconds = Histogram(p + "source_pack_seconds",
                                             "Time to pack one stream chunk into staging.",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.source_packed_bytes = counter("source_packed_bytes",
                                           "KV bytes packed into staging for streams.")
        for ph in PHASES:  # every series exists from the start (dashboards, rate())
            self.phase_seconds.labels(phase=ph)
        for status in SOURCE_STATUSES:
            self.source_requests.labels(status=status)
        for result in DIRECT_READ_RESULTS:
            self.direct_reads.labels(result=result)
        for path in PAIR_PATHS:
            self.pairs_pulled.labels(path=path)
        for reason in CONNECTION_REFUSALS:
            self.source_connections_refused.labels(reason=reason)
        for reason in CONNECTION_CLOSES:
            self.source_connections_closed.labels(reason=reason)

    # ------------------------------------------------------------------- destination side

    def hint_received(self) -> None:
        self.hints_received.inc()

    def hint_accepted(self) -> None:
        self.hints_accepted.inc()

    def hint_ignored(self, reason: str) -> None:
        self.hints_ignored.labels(reason=_label("reason", reason)).inc()

    def metadata_fetch_failed(self, reason: str) -> None:
        self.metadata_fetch_failures.labels(reason=_label("reason", reason)).inc()

    def transfer_failed(self, reason: str) -> None:
        self.transfer_failures.labels(reason=_label("reason", reason)).inc()

    def fallback(self, reason: str) -> None:
        self.fallbacks.labels(reason=_label("reason", reason)).inc()

    def pull_finished(self, outcome: str) -> None:
        self.pulls.labels(outcome=_label("outcome", outcome)).inc()

    def transferred(self, blocks: int, nbytes: int) -> None:
        """Blocks received and committed, and their bytes."""
        self.blocks_transferred.inc(_count("blocks", blocks))
        self.bytes_transferred.inc(_count("bytes", nbytes))

    def skipped(self, blocks: int) -> None:
        self.blocks_skipped.inc(_count("blocks", blocks))

    def direct_read(self, result: str) -> None:
        """A direct read ended: ``used``, ``missing`` (a hash not in the directory),
        ``changed`` (a block changed while read) or ``failed`` (the lanes failed)."""
        self.direct_reads.labels(result=_label("direct read", result)).inc()

    def pair_pulled(self, path: str, pairs: int = 1) -> None:
        """``pairs`` pairs' bytes arrived by ``path`` (:data:`PAIR_PATHS`)."""
        if path not in PAIR_PATHS:
            raise ValueError(f"pair path {path!r} is not one of {PAIR_PATHS}")
        self.pairs_pulled.labels(path=path).inc(_count("pairs", pairs))

    def pull_started(self) -> None:
        self.pulls_in_flight.inc()

    def pull_ended(self) -> None:
        self.pulls_in_flight.dec()

    @contextlib.contextmanager
    def pull_in_flight(self) -> Iterator[None]:
        """``with metrics.pull_in_flight():`` counts one in-flight pull for the block."""
        self.pull_started()
        try:
            yield
        finally:
            self.pull_ended()

    def observe_phase(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        if seconds < 0:
            raise ValueError(f"phase {phase!r} duration {seconds} s is negative")
        self.phase_seconds.labels(phase=phase).observe(seconds)

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """``with metrics.phase("unpack"):`` observes the block's duration (also on error)."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe_phase(phase, time.perf_counter() - t0)

    # ------------------------------------------------------------------------ source side

    def source_request(self, status: str) -> None:
        self.source_requests.labels(status=_label("status", status)).inc()

    def source_served(self, blocks: int, nbytes: int) -> None:
        self.source_blocks_served.inc(_count("blocks", blocks))
        self.source_bytes_sent.inc(_count("bytes", nbytes))

    def source_send_failed(self, reason: str) -> None:
        self.source_send_failures.labels(reason=_label("reason", reason)).inc()

    def source_connection_refused(self, reason: str) -> None:
        """A UCX connection turned away before it was served (:data:`CONNECTION_REFUSALS`)."""
        self.source_connections_refused.labels(reason=_label("reason", reason)).inc()

    def source_connection_closed(self, reason: str) -> None:
        """A served connection closed by the source (:data:`CONNECTION_CLOSES`)."""
        self.source_connections_closed.labels(reason=_label("reason", reason)).inc()

    def watch_http(self, counts: Callable[[], dict[str, int]]) -> None:
        """Add ``counts()`` (reason of :data:`HTTP_REFUSALS` -> a count that only grows) to
        ``kvkern_source_http_refused_total`` at each scrape from now on (also once the server
        closed: a counter never goes down)."""
        unknown = [k for k in counts() if k not in HTTP_REFUSALS]
        if unknown:
            raise ValueError(f"not HTTP refusal reasons: {unknown}")
        self._http_refusals.sources.append(counts)

    def source_pins_changed(self, delta_blocks: int) -> None:
        self.source_pinned_blocks.inc(delta_blocks)

    def source_send_started(self) -> None:
        self.source_sends_in_flight.inc()

    def source_send_ended(self, seconds: float | None = None) -> None:
        self.source_sends_in_flight.dec()
        if seconds is not None:
            self.source_send_seconds.observe(max(seconds, 0.0))

    def source_packed(self, nbytes: int, seconds: float) -> None:
        """One chunk packed: its bytes and the pack's time (launch to its event, on the
        packing thread)."""
        self.source_packed_bytes.inc(_count("bytes", nbytes))
        self.source_pack_seconds.observe(max(seconds, 0.0))

    # ---------------------------------------------------------------------------- export

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (``"kvkern_fallbacks_total"``, reason="miss"); 0.0
        when the series does not exist yet. For tests and logs."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else float(v)
