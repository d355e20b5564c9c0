"""A host that stays gone: after the restarts are spent, plan it out and go on with the rest.

`launch run --restart N` (with --replan, its default when N > 0) first spends its N
restarts on the same hosts, so a host that comes back in the meantime (a replugged
cable, a Mac waking up) keeps its place. When the last attempt has failed too, the
Replanner probes every remote host: a TCP connect to its ring IP (ips[0]) on the ssh
port, from this machine. A connection accepted or refused means the host's kernel
answered; a timeout or "no route" means it is gone. A remote rank whose ssh client
failed with ssh's own status 255 (could not connect, connection lost) counts as gone
too. Local hosts (127.0.0.1) are this machine and never gone.

The gone hosts are dropped from the hostfile (ranks renumbered, RDMA columns
dropped with them), the split is planned again by the same memory planner over the
rest (or, when a host's memory is unknown, `--split auto` with TRINITY_PLAN for the
rest, planned by the ranks at start-up), and the ring starts on them with a fresh
restart budget: the new host set is a new ring, and every re-plan drops a host, so
it ends. When the model does not fit on the rest, or rank 0's host is gone while
it served (--serve/--http/--metrics: that address lived on the lost machine), the
launcher gives up with one line naming the host. Behind the launcher's router the
endpoint lives in the launcher and rank 0 serves only the router, on an internal
address: then the next host becomes rank 0 with an internal address of its own,
and the router calls it there (move_rank0). Either way the HostSet
(launch/host_set.py) is told, for the launcher's front end.

What counts here is what the ranks' ring needs: the probe asks only whether a host
answers at all, so a host that answers but keeps failing is not planned out (the
launcher exits, as without --replan).
"""

import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional, Set

from distributed import TrinityError
from distributed.command_line import read_command
from distributed.shard.memory import DEFAULT_MARGIN
from distributed.shard.plan import Plan, plan_layers
from distributed.startup.auto_split import PLAN_ENV, plan_spec

from .host_set import HostSet, LostHost
from .hostfile import Hostfile
from .ring import Failure, log
from .ssh_ring import SSH_FAILED

PROBE_PORT = 22  # ssh's: open on every host SshRing can reach; refused still means "there"
PROBE_TIMEOUT_S = 3.0


def probe(ip: str, port: int = PROBE_PORT, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """None if the host answers (a connection accepted or refused), else why not."""
    try:
        socket.create_connection((ip, port), timeout=timeout).close()
        return None
    except ConnectionRefusedError:
        return None
    except socket.timeout:
        return f"no answer at {ip}:{port} within {timeout:g} s"
    except OSError as e:
        return f"{ip}:{port} unreachable ({e.strerror or e})"


def drop_hosts(hf: Hostfile, ranks: Set[int]) -> Hostfile:
    """The hostfile without the hosts of `ranks`: the rest renumbered in order, each
    host's RDMA list (one entry per host, jaccl) without the dropped hosts' columns."""
    kept = [h for h in hf.hosts if h.rank not in ranks]
    hosts = [replace(h, rank=i, rdma=[d for j, d in enumerate(h.rdma) if j not in ranks] if h.rdma else [])
             for i, h in enumerate(kept)]
    return Hostfile(hosts, hf.backend, list(hf.envs), None)


def make_plan(config: dict, tensor_sizes, hf: Hostfile, context: int, margin: float,
              draft_model=None) -> Plan:
    """The plan for `hf`'s hosts; draft_model: --draft-model (or its config), held by rank 0
    beside its layers."""
    from distributed.shard.draft import draft_reserve

    return plan_layers(config, [h.memory_bytes for h in hf.hosts], [h.speed for h in hf.hosts],
                       context, tensor_sizes, hf.names, margin, draft_reserve(draft_model, context, len(hf.hosts)))


class DoesNotFit(TrinityError):
    def __init__(self, plan: Plan):
        super().__init__(plan.shortfall())
        self.plan = plan


@dataclass
class Layout:
    """The rank command and --env values for one host set."""

    command: List[str]
    envs: List[str] = field(default_factory=list)
    plan: Optional[Plan] = None  # the launcher's plan; None: planned at start-up (--split auto) or not at all

    def describe(self, hf: Hostfile) -> str:
        """e.g. "A layers 0-9, C layers 10-19"."""
        if self.plan is not None:
            return ", ".join(f"{h.host} layers {h.start}-{h.end - 1}" for h in self.plan.hosts)
        how = ("the ranks plan the split at start-up" if read_command(self.command).settings.ring.split == "auto"
               else "no split planned")
        return ", ".join(hf.names) + f" ({how})"


class Planner:
    """The command for a host set: `--split` from the memory planner, or `--split auto` with
    TRINITY_PLAN when some host's memory is unknown. config None: the command as it is
    (--no-plan, or the user's own --split, which fits only its own number of hosts)."""

    def __init__(self, command: List[str], config: Optional[dict] = None, sizes=None, context: int = 0,
                 margin: float = DEFAULT_MARGIN):
        self.command, self.config, self.sizes, self.context, self.margin = list(command), config, sizes, context, margin

    def with_command(self, command: List[str]) -> "Planner":
        """This planner for another command (rank 0 moved, the router's internal address)."""
        return Planner(command, self.config, self.sizes, self.context, self.margin)

    def lay_out(self, hf: Hostfile) -> Layout:
        settings = read_command(self.command).settings
        if self.config is None:
            split = settings.ring.split
            if split not in (None, "auto") and len(split.split(",")) != len(hf.hosts):
                raise TrinityError(f"--split {split} was given for {len(split.split(','))} hosts, not "
                                   f"{len(hf.hosts)} (leave --split out to let the launcher plan it)")
            return Layout(list(self.command))
        if settings.ring.tensor_parallel_size > 1:
            return self._tensor_layout(hf, settings.ring.tensor_parallel_size)
        if any(h.memory_bytes is None for h in hf.hosts):  # measured, exchanged and planned by the ranks
            return Layout([*self.command, "--split", "auto"], [f"{PLAN_ENV}={plan_spec(hf.hosts, self.margin, self.context)}"])
        plan = make_plan(self.config, self.sizes, hf, self.context, self.margin, settings.speculation.draft_model)
        if not plan.fits:
            raise DoesNotFit(plan)
        return Layout([*self.command, "--split", ",".join(map(str, plan.split))], [], plan)

    def _tensor_layout(self, hf: Hostfile, size: int) -> Layout:
        """--tensor-parallel-size: the ranks split the layers evenly themselves (no --split). A host
        set it does not divide (a re-plan without a lost host) runs the largest size that runs there
        (dividing the hosts and the model; T < N only under MPI), the pipeline (1) at least."""
        from distributed.shard.sizes import model_args, model_sizes
        from distributed.shard.tensor import check_tensor_size

        from .tensor_plan import tensor_plan

        def runs(t: int) -> bool:
            try:
                check_tensor_size(model_args(self.config), t, self.config.get("quantization"))
            except TrinityError:
                return False
            return len(hf.hosts) % t == 0 and (t == len(hf.hosts) or hf.backend == "mpi")

        if len(hf.hosts) % size:
            smaller = max(t for t in range(1, size) if t == 1 or runs(t))
            log(f"--tensor-parallel-size {size} does not run on these {len(hf.hosts)} hosts: {smaller} instead")
            return self.with_command([*self.command, "--tensor-parallel-size", str(smaller)]).lay_out(hf)
        if any(h.memory_bytes is None for h in hf.hosts):  # the ranks' start-up check measures and checks
            return Layout(list(self.command))
        groups = [list(range(s, s + size)) for s in range(0, len(hf.hosts), size)]
        plan = tensor_plan(model_sizes(self.config, self.sizes), hf, groups, self.context, self.margin)
        if not plan.fits:
            raise DoesNotFit(plan)
        return Layout(list(self.command), [], plan)


def gone_after(restarts: int) -> str:
    return "at the first failure" if restarts == 0 else \
        f"after {restarts} restart{'' if restarts == 1 else 's'}"


class Replanner:
    """The Supervisor's hook once an attempt failed with no restarts left: returns the
    next make_ring (the ring re-planned without the gone hosts), or None to give up.

    start(hostfile, layout) -> make_ring starts rings of that host set;
    probe(ip) -> None or why that host is gone (a parameter so that tests can aim it)."""

    def __init__(self, hostfile: Hostfile, planner: Planner, start: Callable[[Hostfile, Layout], Callable],
                 restarts: int, host_set: Optional[HostSet] = None,
                 probe: Callable[[str], Optional[str]] = probe,
                 move_rank0: Optional[Callable[[Hostfile, List[str]], List[str]]] = None):
        self.hostfile, self.planner, self.start, self.restarts = hostfile, planner, start, restarts
        self.host_set = host_set if host_set is not None else HostSet(hostfile.names)
        self.probe = probe
        # The launcher's router (launch/router/), whose endpoint outlives rank 0's host:
        # move_rank0(rest, command) -> the command with rank 0's --serve on rest's first host.
        self.move_rank0 = move_rank0

    def find_lost(self, failure: Optional[Failure]) -> List[LostHost]:
        """Every remote host that does not answer (probed together), and the failed rank's
        host when its ssh client could not connect."""
        remote = [h for h in self.hostfile.hosts if not h.is_local and h.ips]
        with ThreadPoolExecutor(max_workers=max(1, len(remote))) as pool:
            answers = dict(zip((h.rank for h in remote), pool.map(lambda h: self.probe(h.ips[0]), remote)))
        for h in remote:
            if answers[h.rank] is None and failure is not None and failure.rank == h.rank \
                    and failure.code == SSH_FAILED:
                answers[h.rank] = f"ssh failed with exit status {SSH_FAILED}"
        return [LostHost(h.ssh, h.rank, h.ips[0], answers[h.rank]) for h in remote if answers[h.rank]]

    def __call__(self, failure: Optional[Failure]) -> Optional[Callable]:
        lost = self.find_lost(failure)
        if not lost:
            probed = [h.ips[0] for h in self.hostfile.hosts if not h.is_local]
            if probed:  # (a ring of local ranks has nothing to plan out: nothing to say)
                log(f"every host answers (probed {', '.join(probed)}): no host to plan out, not re-planning")
            return self._give_up("the ring keeps failing" + (f" ({failure.describe()})" if failure else "")
                                 + " and every host answers")
        one = len(lost) == 1
        why = lost[0].reason if one else "; ".join(f"{h.name}: {h.reason}" for h in lost)
        gone = (("host " if one else "hosts ") + ", ".join(f"{h.name} (rank {h.rank}, {h.ip})" for h in lost)
                + (" is" if one else " are") + f" gone {gone_after(self.restarts)} ({why})")
        short = ", ".join(f"host {h.name} (rank {h.rank})" for h in lost) + (" is" if one else " are") + " gone"
        rest = drop_hosts(self.hostfile, {h.rank for h in lost})
        rank0_lost = any(h.rank == 0 for h in lost)
        given = read_command(self.planner.command).settings.serving
        serving = [(flag, address) for flag, address in (("--serve", given.serve), ("--http", given.http),
                                                         ("--metrics", given.metrics)) if address is not None]
        # Behind the router, rank 0's --serve is internal: it moves with rank 0.
        fixed = [(flag, address) for flag, address in serving if flag != "--serve" or self.move_rank0 is None]
        if rank0_lost and fixed:
            flag, address = fixed[0]
            log(f"error: {gone}: rank 0 served {flag} {address} "
                "there, which cannot move to another host: not re-planning")
            return self._give_up(f"{short}, and it served this endpoint")
        if not rest.hosts:
            log(f"error: {gone}: no host left")
            return self._give_up(f"{short}: no host left")
        if rank0_lost and serving:  # (if the rest cannot hold the model, the router gives up anyway)
            self.planner = self.planner.with_command(self.move_rank0(rest, self.planner.command))
        try:
            layout = self.planner.lay_out(rest)
        except DoesNotFit as e:
            log(f"error: {gone}: the model does not fit on the other {len(rest.hosts)} "
                f"host{'s' if len(rest.hosts) != 1 else ''}: "
                + str(e).replace("\n", "; "))
            return self._give_up(f"{short} and the model does not fit on the rest")
        except TrinityError as e:
            log(f"error: {gone}, and re-planning over the rest failed: {e}")
            return self._give_up(f"{short} and the ring cannot be re-planned without it")
        log(f"{gone}: re-planned over {len(rest.hosts)} host{'s' if len(rest.hosts) != 1 else ''}: "
            f"{layout.describe(rest)}")
        self.hostfile = rest
        self.host_set.replanned(rest.names, lost)
        return self.start(rest, layout)

    @property
    def give_up_reason(self) -> Optional[str]:
        """Why it gave up, in one line for clients; None while it has not (launch/supervisor.py's Replan)."""
        return self.host_set.unavailable

    def _give_up(self, reason: str) -> None:
        self.host_set.gave_up(reason)
        return None

