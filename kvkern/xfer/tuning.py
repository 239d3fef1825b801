"""The transfer path's tuning constants, in one place, each with the reason for its value.

The modules that use a constant import it from here under the same name, or read it here
(``tuning.READ_DRAIN_S``) where tests change it. Per-deployment settings
are fields of :class:`kvkern.xfer.config.XferConfig` and
:class:`kvkern.xfer.source_config.SourceConfig`; the ``DEFAULT_*`` values below are their
defaults or the bounds of calls that take no setting.

Not here, because they are part of the wire protocol and both peers must agree on them: the
caps a decoder accepts (:mod:`kvkern.xfer.messages` ``MAX_*``), the tag layout and the control
frame sizes of :mod:`kvkern.xfer.transport` (``TRANSFER_ID_BITS``, ``CONTROL_FRAME_BYTES``,
``MAX_CONTROL_FRAME_BYTES``, ``AUTH_FRAME_BYTES``) and the credential sizes of
:mod:`kvkern.xfer.auth`.
"""

from __future__ import annotations

__all__ = [
    "BODY_TIMEOUT_S", "CANCEL_SEND_TIMEOUT_S", "DEFAULT_AUTH_TIMEOUT_S",
    "DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_HINT_TTL_S", "DEFAULT_IDLE_CONNECTION_S",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_SEND_S", "DEFAULT_PROGRAM_FRACTION", "DEFAULT_PROGRESS_TIMEOUT_S",
    "DEFAULT_READ_HOLD_S",
    "DEFAULT_TIMEOUT_S", "HOLD_MARGIN_S", "HOLD_RATE_SLACK", "HTTP_SKEW_S", "LANE_DRAIN_POLL_S",
    "DIRECTORY_READ_COST_BYTES", "IDLE_SWEEP_MAX_S", "LANE_RETRY_S", "LANE_UCX_CONFIG",
    "MAX_CACHED_RKEYS",
    "MAX_CACHED_SOURCES", "REFRESH_AHEAD",
    "MAX_HINT_TTL_S", "MAX_LANE_PEERS", "MAX_SEEN_NONCES", "MAX_UNTRUSTED_CONNECTIONS",
    "OWNED_DRAIN_POLL_S",
    "PACK_WAIT_S", "QUOTA_POLL_S",
    "QUOTA_WAIT_S", "READ_CANCEL_GRACE_S", "READ_DRAIN_S", "REFUSAL_SEND_S",
    "SCATTER_MAX_BYTES", "STATE_CACHE_BYTES",
    "SCATTER_MAX_PIECES",
    "SPLIT_ALIGN",
]

# ---------------------------------------------------------------- transport (UCXX)

# A bound for one transport operation called without its own timeout: no wait is unbounded.
DEFAULT_TIMEOUT_S = 30.0
# A connect that has not completed by then is failed (the puller's deadline is usually
# shorter and bounds it first).
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Chunks posted at once on a stream by default: enough to keep the wire busy while the next
# chunk is packed or unpacked, few enough to bound the staging memory.
DEFAULT_MAX_IN_FLIGHT = 4
# Connections a listener holds between their arrival and their authentication (each bounded
# in time by the handshake and the proof); more are closed as they arrive.
MAX_UNTRUSTED_CONNECTIONS = 256
# The body of a control frame split in two must follow its preamble within this.
BODY_TIMEOUT_S = 5.0
# The authentication exchange (Hello, Challenge, Proof) must complete within this.
DEFAULT_AUTH_TIMEOUT_S = 5.0
# Unpacked remote keys kept per lane endpoint: one per registered region of the source rank
# (a per-layer pool registers one per layer), as many as a read grant may name.
MAX_CACHED_RKEYS = 4096
# How long an aborted read may take to end before ReadsStuck (its local memory is then
# quarantined rather than risk a late write).
READ_DRAIN_S = 5.0
# A cancelled read may finish within this and keep the lane endpoint that other pulls share.
READ_CANCEL_GRACE_S = 0.1

# ---------------------------------------------------------------- read lanes

# Endpoints (source workers) a read lane keeps open, least recently used first out. Each
# source rank is a worker (a TP 8 source node is 8), and a read that must open its endpoint
# again took 0.7 ms against 0.2 ms (one lane, in one process).
MAX_LANE_PEERS = 64
# A lane set's script is overdue past LANE_DUE_S plus its bytes at LANE_DUE_BYTES_PER_S; the
# scripts behind it then go to the next set (XferConfig.read_lane_sets). A 64 MiB pull is due
# in 117 ms, where it reads in 6-8 ms idle and 12-25 ms beside an engine's Python thread.
LANE_DUE_S = 0.05
LANE_DUE_BYTES_PER_S = 1e9
# ... and a set's first script, which opens its lanes' UCX workers (127 ms on 2 cores), this
# much more.
LANE_OPEN_S = 1.0
# Lane shares are cut at page multiples of a run, so no page is split between two lanes.
SPLIT_ALIGN = 4096
# A lane draining an aborted endpoint's reads polls at this interval when UCX made no
# progress.
LANE_DRAIN_POLL_S = 0.001
# Past READ_DRAIN_S, a drain of reads into memory the engine owns (which waits for them
# however long: kvkern.xfer.read_lanes) polls at this interval.
OWNED_DRAIN_POLL_S = 0.01
# UCX settings of a lane's own context (on top of the UCX_* environment). CMA progresses at
# most CMA_TX_QUOTA queued copies per progress call (default 1): a pull from a per-layer
# pool is thousands of 32-64 KiB reads, and one progress call per read made scattered HND
# pulls 0.66-0.80 of raw; 64 per call gave 0.94-0.99 (kvkern bench xfer --pull-layout vllm_hnd).
# CMA moves one CMA_SEG_SIZE segment of a copy per progress call, holding the worker: 16 MiB
# segments (UCX: 512 KiB) made 64 MiB pulls 6.4-7.7 ms against 7.6-8.8 ms and 256 MiB
# 22.0-23.1 against 23.5-27.5 ms. A lane's worker is its own, so nothing else waits on it
# (ucxx's worker copies 4 MiB per call: kvkern.xfer.ucx_env). A read's time bound is checked
# between segments, so a read can end up to one segment's copy after it.
LANE_UCX_CONFIG = {"CMA_TX_QUOTA": "64", "CMA_SEG_SIZE": "16M"}
# A read on the loop lane (the event loop's own UCX worker) polls its worker and yields to the
# loop between polls for this long, then polls on a timer: one-sided reads of a pull small
# enough for that lane land within microseconds (CMA copies them during the first poll), and
# a slow one never keeps the loop busy.
LOOP_SPIN_S = 200e-6
# A direct read looks its hashes up by reading their directory buckets, or the whole
# directory when that is at most this many bytes per hash; buckets (and slots) at most this
# many bytes apart share one read: a small one-sided read costs about as long as moving this
# many bytes (1-2 us against 10 GB/s and more).
DIRECTORY_READ_COST_BYTES = 16 << 10
# A read scattered over the destination's rows (a reshard's source block, kvkern.xfer.ucp_rma
# .Scatter) covers consecutive source blocks up to this many local pieces and bytes, so a
# pull's reads still split evenly over the lanes.
SCATTER_MAX_PIECES = 256
SCATTER_MAX_BYTES = 4 << 20
# After its read lanes failed, a source worker is streamed from for this long.
LANE_RETRY_S = 60.0

# ---------------------------------------------------------------- destination

# A stream asks for its own chunks per run of consecutive receive blocks of at least this
# many bytes, landing in place; shorter runs share chunks unpacked from staging. 64 MiB host
# streams into runs of 8 / 4 / 2 MiB, each run its own chunks: 11.9 / 15.6 / 17.5 ms, against
# 17.5 / 18.1 / 16.7 ms unpacked from staging (medians of 30 interleaved pulls each). A source
# sends its runs of consecutive pool blocks this long from the pool, in chunks of their own.
STREAM_MIN_RUN_BYTES = 4 << 20
# A chunk that lands in place (a run of consecutive receive blocks) may be this large: no
# staging holds it on either side; chunks through staging keep to XferConfig.chunk_bytes.
# A 256 MiB host stream of consecutive blocks: 0.84-0.89 of a raw send in 16 MiB chunks,
# 0.87-0.89 in 64 MiB chunks, 0.90-0.94 in chunks this large (three interleaved runs each).
# Each chunk must land within XferConfig.transfer_timeout_s (10 s: 27 MB/s at this size).
ZERO_COPY_CHUNK_BYTES = 256 << 20

# Hints name arbitrary sources, so the per-source caches (state, verdicts) stay bounded.
MAX_CACHED_SOURCES = 4096
# The state documents a puller keeps, together: a source's is a few KiB, one of up to
# XferConfig.max_state_bytes (1 MiB) parses to about 5 MiB
STATE_CACHE_BYTES = 64 << 20
# A cached source state or endpoint verdict older than this share of its time to live is
# still used, and fetched again meanwhile: a source pulled from steadily never makes a pull
# wait for its state (a state fetch took 3-10 ms on loopback).
REFRESH_AHEAD = 0.5
# A read counts without ReadAck only if it ended before the source's hold did: the two
# hosts' clocks may run at rates this far apart...
HOLD_RATE_SLACK = 1e-3
# ...and this fixed margin is taken off the hold as well.
HOLD_MARGIN_S = 1e-3
# A Cancel is best effort (an aborted connection tells the source by itself): it gets this.
CANCEL_SEND_TIMEOUT_S = 1.0

# ---------------------------------------------------------------- source

# A send may take this long at most: TRT-LLM's kv_transfer_timeout_ms default.
DEFAULT_MAX_SEND_S = 60.0
# a source's answer that pins nothing (a refusal, an ack) is sent within this at most
REFUSAL_SEND_S = 5.0
# Requests of one connection answered or served at once, at most; one more aborts the
# connection. A destination shares a connection between its concurrent pulls (one request
# each), and each task here holds its decoded request (up to a megabyte) until it ends.
MAX_OPEN_REQUESTS_PER_CONNECTION = 64
# A source closes an authenticated connection that has had no request open and no message
# for this long (SourceConfig.idle_connection_s); it looks for such connections a few times
# per period, and at least every IDLE_SWEEP_MAX_S.
DEFAULT_IDLE_CONNECTION_S = 600.0
IDLE_SWEEP_MAX_S = 30.0
# The smallest chunks a source cuts a stream into for a request (or one block's bytes,
# where a block is smaller): each chunk costs a message and a step of Python on both
# sides, so a request for 1-byte chunks of 64 cached blocks planned 2**20 chunks for 2.2 s.
MIN_CHUNK_BYTES = 64 << 10
# A stream that moves nothing this long is stuck.
DEFAULT_PROGRESS_TIMEOUT_S = 10.0
# Read pins are granted this long (capped by the request's deadline).
DEFAULT_READ_HOLD_S = 5.0
# A release waits this long for a packing thread still reading the pool.
PACK_WAIT_S = 5.0
# A request over a pin quota waits this long for the peer's ending sends, polling at
# QUOTA_POLL_S, before it is answered busy.
QUOTA_WAIT_S = 0.05
QUOTA_POLL_S = 0.002

# ---------------------------------------------------------------- authentication

# A signed HTTP request is accepted this long either side of the server's clock.
HTTP_SKEW_S = 30.0
# Nonces remembered against replays within that window; beyond it the oldest go first.
MAX_SEEN_NONCES = 1 << 16
# A router's hint signature is valid this long by default...
DEFAULT_HINT_TTL_S = 30.0
# ...and at most this long, whatever the router asks for.
MAX_HINT_TTL_S = 600.0

# ---------------------------------------------------------------- device streams

# A pull's pack and unpack are memory-bound copies; a quarter of the SMs (33 of an H200's
# 132) with 16 KiB tiles keep ~0.5 MB in flight, ~0.5 TB/s at ~1 us memory latency, above
# what NVLink (450 GB/s a direction) or a NIC carries, so the wire stays the bottleneck while
# three quarters of the SMs stay with the forward pass (an estimate; bench/run_device.sh
# measures a capped grid in its `kernels` step).
DEFAULT_PROGRAM_FRACTION = 0.25
