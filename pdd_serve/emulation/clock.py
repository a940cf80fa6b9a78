"""Slow motion: the one clock an emulated graph runs on.

An emulated engine (pacer.py) computes its real forward on this machine's CPU, then sleeps out the
time the cost model gives the emulated chip. On a CPU that real work often takes longer than the
modelled step of a big model on a fast chip, and the run would measure the CPU, not the chip. So
an emulated graph runs in slow motion: every modelled step, link delay and cross-site timeout is
`time_scale` times longer in real time, the CPU's work becomes a small share of each step, and
every time the graph reports is divided back into emulated seconds.

`time_scale` is one graph-wide field (`PDDConfig.time_scale`, 1 unemulated): the link between the
sites runs on one clock. This module is the only code that does arithmetic with it; everything
else asks a `Clock` for emulated or real time.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TIME_SCALE = 1e6  # time_scale lies in (0, MAX_TIME_SCALE)


@dataclass(frozen=True)
class Clock:
    """Converts between real seconds (what this machine waits) and emulated seconds (what the
    emulated graph would take, and what every report shows)."""

    time_scale: float = 1.0  # real seconds per emulated second

    def __post_init__(self) -> None:
        if isinstance(self.time_scale, bool) or not isinstance(self.time_scale, (int, float)) \
                or not 0 < self.time_scale < MAX_TIME_SCALE:
            raise ValueError(f"time_scale must be a number in (0, 1e6), got {self.time_scale!r}")

    def real(self, emulated_s: float) -> float:
        """An emulated duration (a modelled step, a link delay, a timeout) as real seconds to wait."""
        return emulated_s * self.time_scale

    def emulated(self, real_s: float) -> float:
        """A real duration (or a real clock reading) as emulated seconds, as reported."""
        return real_s / self.time_scale

    def slower(self, factor: float = 2.0) -> Clock:
        """The clock a run whose CPU work overran the modelled steps should try next; this clock
        itself when `factor` times slower would pass MAX_TIME_SCALE (a warning suggests it, and a
        warning must not raise)."""
        scale = self.time_scale * factor
        return Clock(scale) if scale < MAX_TIME_SCALE else self
