"""Stand-ins for :class:`kvkern.xfer.ucp_rma.ReadBatch` shared by the read tests
(test_ucp_rma: reads on a connection; test_read_lanes: reads on read lanes)."""

from __future__ import annotations

from kvkern.xfer import ucp_rma


def held_batch_class(made: list) -> type:
    """A ReadBatch whose real requests' completion polling is held until its wait gave up
    (a CMA read is done before it could time out or be stopped); each one is appended to
    ``made``."""

    class HeldBatch(ucp_rma.ReadBatch):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.hold = True
            made.append(self)

        def poll(self):
            return False if self.hold else super().poll()

        def wait(self, timeout, cancelled=None):
            try:
                return super().wait(timeout, cancelled)
            finally:
                self.hold = False

    return HeldBatch


class NeverDone:
    """A batch that never completes, not even after its endpoint is aborted or closed."""

    stuck = True
    posted = 1

    def __init__(self, key, runs, **kw):
        pass

    def post(self, ep_handle):
        pass

    def wait(self, timeout, cancelled=None):
        raise TimeoutError("never")

    def poll(self):
        return False
