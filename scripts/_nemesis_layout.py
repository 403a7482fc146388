"""The timings and the layout of a nemesis run (scripts/nemesis.py): the deadlines every
process is given, and the hosts, ranks and elastic world of the cluster
(scripts/_nemesis_cluster.py starts it).
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class Timings:
    """The deadlines of the run (docs/recovery.rst explains each choice).

    ``scale`` is ``FLODL_NET_TIMEOUT_SCALE`` for every child: ``handshake_timeout`` (10 s) and
    ``write_stall_timeout`` (30 s) are scaled by it. The relays' and ranks'
    ``coord_liveness_timeout`` are given on their command lines: the relay's 2/3 of the ranks'
    (docs/deadlines.rst), and both long enough that a leader stopped a little past its lease
    (``coord-stop``) is left for the standby by the store's lease, not by its relays' silence.
    The lease is given on the store URL with the test cluster's election timeout (0.5 s), so
    that it is the shortest etcd accepts for three members (docs/failover.rst).
    """

    scale: float = 0.2
    heartbeat_timeout: float = 6.0   # coordinator --heartbeat-timeout
    resume_timeout: float = 10.0     # coordinator --resume-timeout
    grace: float = 20.0              # relay --coordinator-grace
    formation_timeout: float = 90.0  # 17 processes starting on 2 busy cores
    lease_ttl: float = 3.0           # ?ttl= on the store URL: min_ttl of 3 members at 0.5 s
    election_timeout: float = 0.5    # the test cluster's (scripts/_etcd.py)
    relay_liveness: float = 8.0      # relay --coord-liveness-timeout
    rank_liveness: float = 12.0      # rank --coord-liveness-timeout (1.5 x the relay's)
    join_window: float = 3.0         # coordinator --join-window: the hosts start within it

    @property
    def coord_liveness(self) -> float:
        """The relays' ``coord_liveness_timeout``: how long they wait for a silent leader."""
        return self.relay_liveness

    @property
    def handshake(self) -> float:
        return 10.0 * self.scale


@attrs.frozen(kw_only=True)
class Layout:
    """The hosts and ranks of a run, and its elastic world (docs/elastic.rst).

    ``hosts`` hosts of ``ranks_per_host`` ranks each are started with the run; ``spares``
    more (``host-4``, ranks 8-9 by default) are not, and join the running cohort only when a
    ``host-join`` fault starts them. The coordinator runs ``--world-size MIN:MAX`` with MAX
    the ranks of every host, spares included, and MIN the started ranks less those of
    ``hosts_down`` hosts: at most that many hosts are under a fault at once, so drains (which
    retire their ranks) can never take the world below MIN, where the failure policy would
    decide instead of the drain.
    """

    hosts: int = 4
    ranks_per_host: int = 2
    spares: int = 1
    hosts_down: int = 2
    epochs: int = 30
    total_samples: int = 1600
    batch_size: int = 4
    batch_ms: float = 100.0

    @property
    def world(self) -> int:
        """The ranks started with the run."""
        return self.hosts * self.ranks_per_host

    @property
    def max_world(self) -> int:
        """MAX of the elastic world: every host's ranks, spares included."""
        return (self.hosts + self.spares) * self.ranks_per_host

    @property
    def min_world(self) -> int:
        """MIN of the elastic world: what is left when ``hosts_down`` hosts drained (never
        fewer than one host's ranks)."""
        down = min(self.hosts_down, self.hosts - 1)
        return max(self.ranks_per_host, self.world - down * self.ranks_per_host)

    @property
    def drains_at_once(self) -> int:
        """How many started hosts may be drained at once without the world going below
        MIN."""
        return (self.world - self.min_world) // self.ranks_per_host

    def ranks_of(self, host: str) -> list[int]:
        h = int(host.rsplit("-", 1)[1])
        return list(range(h * self.ranks_per_host, (h + 1) * self.ranks_per_host))

    @property
    def host_names(self) -> list[str]:
        """The hosts started with the run (the faults on hosts draw from these)."""
        return [f"host-{h}" for h in range(self.hosts)]

    @property
    def spare_names(self) -> list[str]:
        """The hosts started only by a ``host-join`` fault."""
        return [f"host-{h}" for h in range(self.hosts, self.hosts + self.spares)]
