"""The emulated hosts' wiring and queues: namespaces, veths, bridge, addresses, neighbours, qdiscs.

Topology (n hosts, everything inside namespaces created here)::

    ns <tag>-h0: lo, <p><pid>h0 10.99.0.1/24 --veth-- <p><pid>b0 \\
    ns <tag>-h1: lo, <p><pid>h1 10.99.0.2/24 --veth-- <p><pid>b1 -+- bridge <p><pid>br
    ...                                                            /  (ns <tag>-br, no address)

Each host's interface gets a ``tbf`` root qdisc (limits what the host sends) and so does
its bridge port (limits what the host receives), so a rank's upload and download are both
capped at the link rate, like a switch port. With the ``netem`` delay backend the host
interface's root is ``netem`` with the tbf as its child; with the user-space delay switch
there is no kernel bridge (the switch forwards between the ports).

Every host knows every other host's MAC address from the start (permanent neighbour
entries; host ``i`` has MAC ``02:99:00:00:HH:LL`` for ``10.99.0.(i+1)``). Without them the
first packets to a peer wait in the kernel's neighbour queue for an ARP reply, which takes
a round trip through the emulated delay, and the kernel flushes that queue one packet at a
time while new packets already go out directly, so a new packet can overtake the queued
ones (seen as ``[0, 101, 1, 2, ...]`` on a loaded machine).

Nothing is done in the root namespace: veths are created inside the bridge namespace with
their peer placed directly into the host namespace, and the 10.99.0.0/24 addresses only
ever exist inside these namespaces.
"""

from __future__ import annotations

import logging
import os

from .cleanup import warn_once
from .commands import NetemCommandError, NetemUnavailable, netem_delay_args, run_cmd, tbf_args, tool_path

__all__ = ["SUBNET", "MAX_HOSTS", "Topology", "host_mac"]

log = logging.getLogger("flexcomm.netem")

#: The only addresses this package assigns, and only inside its own namespaces.
SUBNET = "10.99.0.0/24"
MAX_HOSTS = 254
_IFNAME_MAX = 15  # IFNAMSIZ - 1
# netem handles used when a delay tree is built (netem root, tbf child).
_NETEM_HANDLE = "1:"
_NETEM_CHILD_PARENT = "1:1"
_TBF_CHILD_HANDLE = "10:"
#: Whether this kernel has the netem qdisc (probed once per process).
_netem_supported: bool | None = None


def host_mac(i: int) -> str:
    """Host ``i``'s MAC: locally administered, and the same low bytes as its address."""
    return f"02:99:00:00:{(i + 1) >> 8:02x}:{(i + 1) & 0xFF:02x}"


class Topology:
    """Names of one cluster's namespaces and interfaces, and the ip/tc commands that build them.

    ``min_burst`` raises every tbf's burst (the delay switch moves whole 64 KiB GSO packets).
    """

    def __init__(self, n_hosts: int, prefix: str, seq: int) -> None:
        pid = os.getpid()
        self.n_hosts = n_hosts
        self.tag = f"{prefix}{pid}-{seq}"
        self.bridge_netns = f"{self.tag}-br"
        self.host_netns = [f"{self.tag}-h{i}" for i in range(n_hosts)]
        self.host_if = [f"{prefix}{pid}h{i}" for i in range(n_hosts)]
        self.port_if = [f"{prefix}{pid}b{i}" for i in range(n_hosts)]
        self.bridge_if = f"{prefix}{pid}br"
        for name in (*self.host_if, *self.port_if, self.bridge_if):
            if len(name) > _IFNAME_MAX:
                raise ValueError(
                    f"interface name {name!r} exceeds Linux's {_IFNAME_MAX}-character limit; use a shorter prefix"
                )
        self.min_burst = 0
        self.netem_tree = False
        self.created_ns: list[str] = []
        self.ip = ""
        self.tc = ""

    @property
    def namespaces(self) -> list[str]:
        """Every namespace name (bridge first)."""
        return [self.bridge_netns, *self.host_netns]

    def host_addr(self, i: int) -> str:
        return f"10.99.0.{i + 1}"

    def links(self) -> list[tuple[str, str]]:
        """``(namespace, device)`` of every shaped interface: host sides, then bridge ports."""
        return list(zip(self.host_netns, self.host_if)) + [(self.bridge_netns, p) for p in self.port_if]

    def _ipn(self, ns: str, *args: str) -> str:
        return run_cmd([self.ip, "-n", ns, *args])

    def tcn(self, ns: str, *args: str) -> str:
        return run_cmd([self.tc, "-n", ns, *args])

    # -- building --------------------------------------------------------------
    def add_namespaces(self) -> None:
        """Create every namespace (recorded at once, so teardown finds even a half-built one)."""
        self.ip, self.tc = tool_path("ip"), tool_path("tc")
        for name in self.namespaces:
            run_cmd([self.ip, "netns", "add", name])
            self.created_ns.append(name)
            self._ipn(name, "link", "set", "lo", "up")

    def wire(self, bridged: bool) -> None:
        """Veths from the bridge namespace to every host, joined by a kernel bridge if ``bridged``."""
        br = self.bridge_netns
        if bridged:
            self._ipn(br, "link", "add", self.bridge_if, "type", "bridge", "stp_state", "0", "forward_delay", "0")
            # No IPv6 link-local addresses: keeps the links silent (no RS/MLD chatter)
            # and leaves each host interface with exactly one address for gloo.
            self._ipn(br, "link", "set", self.bridge_if, "addrgenmode", "none")
            self._ipn(br, "link", "set", self.bridge_if, "up")
        for i in range(self.n_hosts):
            self._wire_host(i, bridged)
        for i in range(self.n_hosts):
            self._add_neighbours(i)

    def _wire_host(self, i: int, bridged: bool) -> None:
        """Veth pair created in the bridge ns with its peer placed straight into host i's ns."""
        br, ns, hif, port = self.bridge_netns, self.host_netns[i], self.host_if[i], self.port_if[i]
        self._ipn(br, "link", "add", port, "type", "veth", "peer", "name", hif, "netns", ns, "address", host_mac(i))
        self._ipn(br, "link", "set", port, "addrgenmode", "none")
        if bridged:  # with the delay switch the ports stay unbridged: it forwards
            self._ipn(br, "link", "set", port, "master", self.bridge_if)
        self._ipn(br, "link", "set", port, "up")
        self._ipn(ns, "link", "set", hif, "addrgenmode", "none")
        self._ipn(ns, "addr", "add", f"{self.host_addr(i)}/24", "dev", hif)
        self._ipn(ns, "link", "set", hif, "up")

    def _add_neighbours(self, i: int) -> None:
        """Permanent neighbour entries for every other host (one ``ip -batch`` per host)."""
        lines = [
            f"neigh replace {self.host_addr(j)} lladdr {host_mac(j)} dev {self.host_if[i]} nud permanent\n"
            for j in range(self.n_hosts) if j != i
        ]  # fmt: skip
        if lines:
            run_cmd([self.ip, "-n", self.host_netns[i], "-batch", "-"], stdin="".join(lines))

    def raise_tcp_buffers(self, max_bytes: int) -> None:
        """Let TCP windows cover bandwidth x RTT: raise tcp_rmem/tcp_wmem maxima in the host namespaces.

        These sysctls are per network namespace, so nothing outside the cluster changes;
        the minimum and default stay as the kernel set them.
        """
        if max_bytes <= 0:
            return
        try:
            sysctl = tool_path("sysctl")
        except NetemUnavailable:
            warn_once("no-sysctl", "netem: no 'sysctl' binary; TCP buffer limits in the hosts left as they are")
            return
        for ns in self.host_netns:
            settings = []
            for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
                values = run_cmd([self.ip, "netns", "exec", ns, sysctl, "-n", key]).split()
                if len(values) == 3 and int(values[2]) < max_bytes:
                    settings.append(f"{key}={values[0]} {values[1]} {max_bytes}")
            if settings:
                run_cmd([self.ip, "netns", "exec", ns, sysctl, "-q", "-w", *settings])

    def netem_supported(self) -> bool:
        """Probe once per process (in host 0's namespace) whether the kernel has the netem qdisc."""
        global _netem_supported
        if _netem_supported is None:
            ns = self.host_netns[0]
            try:
                self.tcn(ns, "qdisc", "add", "dev", "lo", "root", *netem_delay_args(0.001))
                self.tcn(ns, "qdisc", "del", "dev", "lo", "root")
                _netem_supported = True
            except NetemCommandError as exc:
                if "unknown" not in exc.stderr.lower():
                    # Some other failure: do not conclude (and cache) "no netem".
                    log.warning("netem: could not probe for the netem qdisc: %s", exc)
                    return False
                _netem_supported = False
        return _netem_supported

    # -- queues ----------------------------------------------------------------
    def set_netem_delay(self, i: int, delay_s: float, jitter_s: float, add: bool = False) -> None:
        """netem root of host ``i``'s interface (egress only: A -> B sees exactly A's delay)."""
        self.tcn(self.host_netns[i], "qdisc", "add" if add else "change", "dev", self.host_if[i], "root",
                 "handle", _NETEM_HANDLE, *netem_delay_args(delay_s, jitter_s))  # fmt: skip
        self.netem_tree = True

    def _tbf(self, rate_bps: float) -> list[str]:
        """:func:`tbf_args` with the burst raised to ``min_burst``."""
        args = tbf_args(rate_bps)
        i = args.index("burst") + 1
        args[i] = str(max(int(args[i]), self.min_burst))
        return args

    def shape(self, rate_bps: float, add: bool = False) -> None:
        """Put (``add``) or change a tbf on both ends of every veth (under netem's root if there is one)."""
        verb = "add" if add else "change"
        for i in range(self.n_hosts):
            ns, dev = self.host_netns[i], self.host_if[i]
            if self.netem_tree:
                self.tcn(ns, "qdisc", verb, "dev", dev, "parent", _NETEM_CHILD_PARENT, "handle", _TBF_CHILD_HANDLE,
                         *self._tbf(rate_bps))  # fmt: skip
            else:
                self.tcn(ns, "qdisc", verb, "dev", dev, "root", *self._tbf(rate_bps))
            self.tcn(self.bridge_netns, "qdisc", verb, "dev", self.port_if[i], "root", *self._tbf(rate_bps))

    def qdisc_show(self) -> str:
        """``tc qdisc show`` of every shaped device, one ``ns dev: ...`` block each."""
        return "\n".join(f"{ns} {dev}: {self.tcn(ns, 'qdisc', 'show', 'dev', dev).strip()}" for ns, dev in self.links())

    # -- teardown --------------------------------------------------------------
    def teardown(self) -> list[str]:
        """Delete every veth and namespace created; return the errors (never raises)."""
        if not self.created_ns:
            return []
        errors: list[str] = []
        ip = self.ip or tool_path("ip")
        if self.bridge_netns in self.created_ns:
            # Deleting one end deletes the pair now; namespace teardown is asynchronous.
            for port in self.port_if:
                try:
                    run_cmd([ip, "-n", self.bridge_netns, "link", "del", port])
                except NetemCommandError:
                    pass  # not created yet, or already gone with its peer
        for ns in self.created_ns:
            try:
                run_cmd([ip, "netns", "delete", ns])
            except NetemCommandError as exc:
                errors.append(str(exc))
        self.created_ns.clear()
        return errors
