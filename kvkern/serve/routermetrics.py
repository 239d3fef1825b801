"""Prometheus metrics of ``kvkern router``, on a registry of their own per router app (so two
routers in one process, as in tests, never share counters).

=======================================  =========  =========================================
name                                     labels     meaning
=======================================  =========  =========================================
kvkern_router_routes_total               worker     requests routed to each destination
kvkern_router_hints_sent_total           dialect    hints attached, by dialect (as workers
                                                    name it: kvkern, kv_hints, dynamo, llm-d)
kvkern_router_hints_not_sent_total       reason     routed requests without a hint:
                                                    no_other_worker, no_longer_prefix,
                                                    no_credential
kvkern_router_worker_healthy             worker     1 healthy, 0 unhealthy
kvkern_router_worker_blocks              worker     blocks the router believes each caches
kvkern_router_request_seconds            endpoint   latency of /v1/generate (forward included)
                                                    and /v1/route, as the router saw it
kvkern_router_requests_total             endpoint,  requests answered, by HTTP status
                                         status
kvkern_router_forward_errors_total       worker,    forwards that got no answer (unreachable:
                                         kind       no connection, or an answer not in
                                                    JSON; timeout) or a 5xx (http_5xx)
kvkern_router_refresh_failures_total     worker     block-listing reads that failed
=======================================  =========  =========================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "RouterMetrics"]

# Request latency buckets (s): a forward is a prefill on the worker, milliseconds to minutes.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    """The router's counters, gauges and histograms on their own registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.routes = Counter("kvkern_router_routes_total",
                              "Requests routed, by destination worker", ["worker"], registry=r)
        self.hints_sent = Counter("kvkern_router_hints_sent_total",
                                  "Hints attached to forwarded requests, by dialect",
                                  ["dialect"], registry=r)
        self.hints_not_sent = Counter("kvkern_router_hints_not_sent_total",
                                      "Routed requests without a hint, by reason", ["reason"],
                                      registry=r)
        self.healthy = Gauge("kvkern_router_worker_healthy",
                             "1 if the router sends requests and hints to the worker",
                             ["worker"], registry=r)
        self.blocks = Gauge("kvkern_router_worker_blocks",
                            "Blocks the router believes the worker caches", ["worker"],
                            registry=r)
        self.latency = Histogram("kvkern_router_request_seconds",
                                 "Request latency seen by the router", ["endpoint"],
                                 buckets=_BUCKETS, registry=r)
        self.requests = Counter("kvkern_router_requests_total",
                                "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.forward_errors = Counter("kvkern_router_forward_errors_total",
                                      "Forwards without an answer or with a 5xx",
                                      ["worker", "kind"], registry=r)
        self.refresh_failures = Counter("kvkern_router_refresh_failures_total",
                                        "Block-listing reads that failed", ["worker"],
                                        registry=r)

    def add_worker(self, worker_id: str) -> None:
        """Create the worker's series at zero, so they exist before the first request."""
        self.routes.labels(worker_id)
        self.healthy.labels(worker_id).set(1)
        self.blocks.labels(worker_id).set(0)
        self.refresh_failures.labels(worker_id)

    def routed(self, decision) -> None:
        self.routes.labels(decision.destination).inc()
        if decision.hint_dialect is not None:
            self.hints_sent.labels(decision.hint_dialect).inc()
        else:
            self.hints_not_sent.labels(decision.no_hint_reason or "no_longer_prefix").inc()

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.latency.labels(endpoint).observe(seconds)
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
