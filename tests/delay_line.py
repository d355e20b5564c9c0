"""A shaped link between network-namespace hosts where the kernel has no tc netem (this
machine's: CONFIG_NET_SCH_NETEM unset, `tc qdisc add … netem` says "unknown qdisc").

One process (this file, run as a script) opens a TUN device per host, moves each into its
host's namespace with an address on a subnet of its own, and forwards every IPv4 packet
between them as netem on each host's interface would: each sender's packets leave one after
another at `rate` Mbit/s (0: unlimited) and arrive `delay` ms later. A line on its stdin,
{"delay_ms": D, "rate_mbit": R}, changes both; end of file ends it, and the TUN devices
(not persistent) go with it. `delay_line(hosts, names)` runs it for the tests.
"""

import contextlib
import fcntl
import heapq
import json
import os
import random
import select
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU = 9000  # fewer packets through this process for the same bytes


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


def attach(fds: dict, name: str, ns: str, address: str) -> None:
    """A TUN device named `name` into namespace `ns`, up, at `address`/24."""
    fd = open_tun(name)
    ip("link", "set", name, "netns", ns)
    ip("-n", ns, "addr", "add", f"{address}/24", "dev", name)
    ip("-n", ns, "link", "set", name, "mtu", str(MTU), "up")
    fds[bytes(int(x) for x in address.split("."))] = fd


class Wire:
    def __init__(self, fds: dict):
        self.by_address = fds
        self.delay_s, self.rate = 0.0, 0.0
        self.free_at = {fd: 0.0 for fd in fds.values()}  # when each sender's interface is free again
        self.queue, self.seq = [], 0

    def take(self, fd: int) -> None:
        packet = os.read(fd, 65536)
        out = self.by_address.get(packet[16:20]) if len(packet) >= 20 and packet[0] >> 4 == 4 else None
        if out is None:
            return
        now = time.perf_counter()
        sent = max(now, self.free_at[fd]) + (len(packet) * 8 / self.rate if self.rate else 0.0)
        self.free_at[fd] = sent
        self.seq += 1
        heapq.heappush(self.queue, (sent + self.delay_s, self.seq, out, packet))

    def deliver(self) -> None:
        now = time.perf_counter()
        while self.queue and self.queue[0][0] <= now:
            _, _, out, packet = heapq.heappop(self.queue)
            os.write(out, packet)

    def run(self) -> None:
        readers = [sys.stdin.fileno(), *self.by_address.values()]
        while True:
            wait = max(0.0, self.queue[0][0] - time.perf_counter()) if self.queue else None
            ready, _, _ = select.select(readers, [], [], wait)
            for fd in ready:
                if fd != readers[0]:
                    self.take(fd)
                    continue
                line = sys.stdin.readline()
                if not line:
                    return
                settings = json.loads(line)
                self.delay_s, self.rate = settings["delay_ms"] / 1e3, settings["rate_mbit"] * 1e6
                print("set", flush=True)
            self.deliver()


def run_as_the_kernel_would() -> None:
    """Real-time priority where allowed (root: the suite's namespaces need it anyway). Netem
    shapes packets in the kernel, ahead of every process; a forwarder that waited for a CPU
    behind the suite's other tests delivered a 100 Mbit/s line at 67 (a fresh clone's CI). It
    sleeps in select between packets, so it takes the CPU only for the packets themselves."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.nice(-10)


def main() -> None:
    hosts = json.loads(sys.argv[1])  # [[tun name, namespace, address], ...]
    run_as_the_kernel_would()
    fds = {}
    for name, ns, address in hosts:
        attach(fds, name, ns, address)
    print("ready", flush=True)
    Wire(fds).run()


class Line:
    def __init__(self, proc: subprocess.Popen, ips: dict):
        self.proc, self.ips = proc, ips  # ips: host name -> its address on the line

    def set(self, delay_ms: float = 0.0, rate_mbit: float = 0.0) -> None:
        self.proc.stdin.write(json.dumps({"delay_ms": delay_ms, "rate_mbit": rate_mbit}) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "set\n"


@contextlib.contextmanager
def delay_line(hosts, names):
    """The hosts `names` of tests/netns_hosts.py's `hosts` joined by a Wire (a free 10.80.X.0/24)."""
    subnet = next(s for s in (f"10.80.{random.randrange(256)}" for _ in range(50))
                  if not subprocess.run(["ip", "route", "show", f"{s}.0/24"], capture_output=True,
                                        text=True).stdout.strip())
    ips = {n: f"{subnet}.{i + 1}" for i, n in enumerate(names)}
    spec = [[f"trdl{hosts.tag}{n[-1]}", n, ips[n]] for n in names]
    proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n", "the delay line did not start"
        yield Line(proc, ips)
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
