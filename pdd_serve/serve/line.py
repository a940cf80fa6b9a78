"""Line: the inter-site line of the graph's one site pair, shared by every sender.

A real line is one pipe between two datacenters: a second Prefill replica shares it, it does not
bring a second line's bandwidth. The emulated line (`transport.link.LinkModel`) is a ledger of
bookings, so one replica holds it and every Prefill replica's Flight streams book their bytes on
it (`transport.link.SharedLine`): the pacing, the Routers' backlog view (the sum of every
sender's `line_state`, each draining its transfers at their share of the line, drained again at
the line's rate) and the simulator's one `SharedPacer` per line all see the same pipe. The catalog prices it per hour (`links.cross_dc`).

Only a paced cross-site graph has one (`needs_line`), and it must have one replica (a second
would split the ledger: keep `num_replicas` unset). It sits at the senders' site (a booking is an
in-site call) and reserves no CPU: it books, it never carries a byte.
"""

from __future__ import annotations

from ray import serve

from pdd_serve.config import PDDConfig
from pdd_serve.serve.common import graph_link, kv_bytes_per_token
from pdd_serve.transport.link import Booking, LinkModel


def needs_line(cfg: PDDConfig) -> bool:
    """A graph whose KV crosses a paced line: its senders share one `Line`."""
    return cfg.sites.prefill != cfg.sites.main_decode and cfg.link.line(2048).paced


def shared_ledger(cfg: PDDConfig, real_bytes_per_token: int) -> LinkModel:
    """The line every sender books on: the graph's link on its clock, counting line bytes (each
    sender scales its real bytes itself, `SharedLine.byte_scale`)."""
    link = graph_link(cfg, real_bytes_per_token)
    return LinkModel(link.config, clock=link.clock)


@serve.deployment(num_replicas=1, max_ongoing_requests=1024)
class Line:
    def __init__(self, cfg: PDDConfig) -> None:
        self.ledger = shared_ledger(cfg, kv_bytes_per_token(cfg.engine_for("prefill")))
        self.bookings = 0
        self.line_bytes = 0.0
        self.senders: set[str] = set()  # the replicas that booked or read the line's clock

    # async: calls run one at a time on the replica's event loop (a booking never blocks), so the
    # counters below need no lock; the ledger keeps its own for the pure model's callers
    async def book(self, flow: str, nbytes: float, chained: bool) -> Booking:
        self.senders.add(flow.rsplit("/", 1)[0])
        if nbytes > 0:
            self.bookings += 1
            self.line_bytes += nbytes
        return self.ledger.book(flow, nbytes, chained)

    async def stats(self) -> dict:
        return {"bookings": self.bookings, "line_bytes": self.line_bytes, "senders": sorted(self.senders),
                "bandwidth_bps": self.ledger.bandwidth_bps, "now_s": self.ledger.now()}
