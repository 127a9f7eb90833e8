"""How long to wait for a draft: TCP's retransmission timeout (RFC 6298) over measured round trips."""

from __future__ import annotations


RTT_FLOOR_S = 0.03  # an oversubscribed host (targets and draft daemon sharing cores) stalls a process
# for tens of milliseconds: with a 10 ms floor, a busy but healthy daemon missed deadlines there
ACK_FLOOR_S = 0.05  # --ack-timeout: an acknowledgement is waited for at least this long: the socket thread
# answers at once, but on a host whose cores are all busy it may wait a scheduler slice or two


class RttEstimator:
    """Smoothed round trip (srtt) and its mean deviation (rttvar), as RFC 6298 keeps them; the
    deadline for a reply is ``clamp(srtt + 4 * rttvar, floor, cap)``, where ``cap`` is the
    configured timeout. Before the first sample the deadline is the cap."""

    ALPHA = 1 / 8  # gain of srtt
    BETA = 1 / 4  # gain of rttvar
    K = 4

    def __init__(self, floor_s: float = RTT_FLOOR_S):
        self.floor_s = floor_s
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.samples = 0

    def observe(self, rtt_s: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt_s, rtt_s / 2
        else:
            self.rttvar = (1 - self.BETA) * self.rttvar + self.BETA * abs(self.srtt - rtt_s)
            self.srtt = (1 - self.ALPHA) * self.srtt + self.ALPHA * rtt_s
        self.samples += 1

    def deadline_s(self, cap_s: float) -> float:
        if self.srtt is None:
            return cap_s
        return min(cap_s, max(self.floor_s, self.srtt + self.K * self.rttvar))
