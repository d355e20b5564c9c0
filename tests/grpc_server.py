"""run_trinity.py --serve as real processes, and what gRPC tests check with it
(tests/serving, tests/startup/test_faults.py, tests/startup/test_netns.py)."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from bench.harness import start_ranks
from conftest import ROOT, RUN, free_port_range, mlx_launch, process_parents, trinity_launch
from distributed.serving.proto import generation_pb2 as pb
from distributed.serving.proto import generation_pb2_grpc as pb_grpc
from reference import PROMPT

IDS = ",".join(map(str, PROMPT))
MAX_TOKENS = 16
SERVICE = "trinity.v1.Generation"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVER_ARGS = ["--max-context", "2048", "--max-tokens-cap", "1024"]
LONG = 1000  # max_tokens of a request that is still running when the test acts (EOS comes at ~400)
# name -> (ranks, extra args, layer ranges)
CONFIGS = {
    "stages2": (1, ["--stages", "2"], [[0, 4], [4, 8]]),
    # Speculating (prompt lookup): every test on it must see the output of the others.
    "ranks2": (2, ["--prompt-lookup", "--speculate", "always", "--num-draft-tokens", "3"], [[0, 4], [4, 8]]),
    "ranks3": (3, ["--split", "3,1,4"], [[0, 3], [3, 4], [4, 8]]),
}


def env(extra=None):
    """The ranks' environment; `extra` is added (a PYTHONPATH in it goes after the checkout's)."""
    extra = dict(extra or {})
    paths = [str(ROOT)] + ([extra.pop("PYTHONPATH")] if "PYTHONPATH" in extra else [])
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), **extra)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    return e


def children(pid: int):
    """Process ids whose parent is pid."""
    return [child for child, parent in process_parents().items() if parent == pid]


class Server:
    """run_trinity.py --serve as real processes: 1 process, N ranks under a launcher (ours,
    `trinity-launch run --single-host N --no-router`, or `mlx.launch -n N`), or N
    processes started by hand (`manual`: MLX_RANK/MLX_HOSTFILE, as mlx.launch sets them,
    but without a launcher that stops every rank when one dies)."""

    def __init__(self, model, ranks=1, extra=(), manual=False, credentials=None, launcher="trinity-launch",
                 environment=None):
        # Port 0: the server picks a free port and logs it, so nothing can take it meanwhile.
        model_args = ["--model", str(model)] if model is not None else []  # None: the embedded default model
        args = [sys.executable, RUN, *model_args, "--serve", "127.0.0.1:0", *extra]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="trinity-serve-", suffix=".log")
        self.procs = []
        # The processes append (O_APPEND) and output() reads the file by name. Handing them
        # self.log would share its offset with our reads: after output()'s seek to 0, their
        # next write would overwrite the log's first lines (such as the port line wait_port needs).
        log = open(self.log.name, "a")
        popen = dict(stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        with log:
            if ranks == 1:
                self.procs.append(subprocess.Popen(args, env=env(environment), **popen))
            elif manual:  # as the benchmarks start a ring (one harness: bench/harness.py)
                out = dict(stdout=log, stderr=subprocess.STDOUT)
                self.procs, self.hostfile = start_ranks(args, ranks, env(environment), rank0=out, others=out)
            elif launcher == "mlx.launch":
                cmd = [mlx_launch(), "-n", str(ranks), "--starting-port", str(free_port_range(ranks + 1)), *args]
                self.procs.append(subprocess.Popen(cmd, env=env(environment), **popen))
            else:
                cmd = [*trinity_launch(ranks), *args]
                self.procs.append(subprocess.Popen(cmd, env=env(environment), **popen))
        self.credentials = credentials
        self.launcher = (launcher if ranks > 1 and not manual else None)  # its name, if any
        self.address = self.channel = None  # known once the server logs its port

    def rank_pid(self, rank: int):
        if not self.launcher:
            return self.procs[rank].pid
        for pid in children(self.procs[0].pid):  # mlx.launch execs each rank in a child shell
            try:
                if f"MLX_RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return pid
            except OSError:
                continue
        return None

    def connect(self):
        if self.credentials is None:
            self.channel = grpc.insecure_channel(self.address)
        else:
            self.channel = grpc.secure_channel(self.address, self.credentials)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def output(self, tail=4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-tail:]

    def health_status(self, service=SERVICE):
        try:
            return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        except grpc.RpcError as e:
            return e.code()

    def alive(self):
        assert all(p.poll() is None for p in self.procs), f"the server exited:\n{self.output()}"

    def wait_port(self, timeout=300):
        """Wait for the port to open (before the weights load), then connect."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.alive()
            listening = re.search(r"gRPC listening on (\S+)", self.output(0))
            if listening:
                self.address = listening.group(1)
                return self.connect()
            time.sleep(0.005)
        raise AssertionError(f"no port after {timeout}s:\n{self.output()}")

    def http_address(self, timeout=60):
        """(host, port) of --http, from rank 0's "serving ..." line, printed just after health
        turns SERVING (so wait for it, not only for SERVING)."""
        end = time.monotonic() + timeout
        while not (found := re.search(r"and (\S+):(\d+) \(HTTP\)", self.output(0))):
            assert time.monotonic() < end, f"no HTTP address after {timeout}s:\n{self.output()}"
            self.alive()
            time.sleep(0.01)
        return found.group(1), int(found.group(2))

    def wait_serving(self, timeout=300):
        """Poll health until SERVING; returns the distinct states seen, in order."""
        if self.channel is None:
            self.wait_port(timeout)
        seen, end = [], time.monotonic() + timeout
        while time.monotonic() < end:
            self.alive()
            status = self.health_status()
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == SERVING:
                return seen
            time.sleep(0.01)
        raise AssertionError(f"not SERVING after {timeout}s (seen {seen}):\n{self.output()}")

    def stop(self):
        """SIGTERM to rank 0 (a clean shutdown stops the ring), then SIGKILL whatever is left."""
        if self.channel is not None:
            self.channel.close()
        rank0 = self.rank_pid(0)
        # Our launcher starts each rank in a session of its own, so its group is not theirs.
        ranks = children(self.procs[0].pid) if self.launcher else []
        try:
            if rank0:
                os.kill(rank0, signal.SIGTERM)
            for p in self.procs:
                p.wait(timeout=10)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        for pid in ranks:
            try:
                if b"MLX_RANK=" not in Path(f"/proc/{pid}/environ").read_bytes():
                    continue  # gone, and its pid taken since

                os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        if getattr(self, "hostfile", None):
            os.unlink(self.hostfile)
            self.hostfile = None


def generate(stub, timeout=120, metadata=None, **fields):
    """One Generate; checks the stream's shape and returns what it carried."""
    out = {"text": "", "token_ids": [], "logprobs": [], "responses": 0}
    for r in stub.Generate(pb.GenerateRequest(**fields), timeout=timeout, metadata=metadata):
        assert not out.get("finish_reason"), "a response after the one with finish_reason"
        if r.prompt_token_ids:  # prompt_logprobs: first, alone
            assert out["responses"] == 0 and not r.token_ids and fields.get("prompt_logprobs")
            out["prompt"] = r
            continue
        out["responses"] += 1
        out.setdefault("top_logprobs", []).extend(r.top_logprobs)
        out["text"] += r.text
        out["token_ids"] += list(r.token_ids)
        out["logprobs"] += list(r.logprobs)
        if r.finish_reason:
            out["finish_reason"], out["usage"] = r.finish_reason, r.usage
            assert not r.token_ids
        else:
            assert len(r.token_ids) == len(r.logprobs) == 1 and not r.HasField("usage")
    assert out.get("finish_reason"), "the stream ended without finish_reason"
    return out


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    """The error fn(...) raises (fn must consume any stream: `rpc_error(list, call)`)."""
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value


def assert_matches(out, ref, n=None):
    """Greedy output equals the command line's (its first n tokens if n)."""
    n = n or len(ref["token_ids"])
    assert out["token_ids"] == ref["token_ids"][:n]
    assert max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"][:n])) < 1e-5
    if n == len(ref["token_ids"]):
        assert out["text"] == ref["text"]


def openssl_cert(directory: Path):
    """A self-signed certificate for 127.0.0.1 (None without openssl)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    proc = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], capture_output=True)
    return (cert, key) if proc.returncode == 0 else None


TOKEN = "s3cret-token"


def reflection_generate(channel, request_fields, call_credentials=None):
    """Generate through server reflection alone: no generated stubs."""
    database = ProtoReflectionDescriptorDatabase(channel)
    services = set(database.get_services())
    pool = descriptor_pool.DescriptorPool(database)
    method = pool.FindServiceByName(SERVICE).methods_by_name["Generate"]
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    call = channel.unary_stream(f"/{SERVICE}/Generate", request_serializer=request_class.SerializeToString,
                                response_deserializer=response_class.FromString)
    responses = list(call(request_class(**request_fields), timeout=60, credentials=call_credentials))
    return services, responses


def client(*args, env_token=None):
    """python -m distributed.client, as a user runs it."""
    e = dict(env(), TRINITY_AUTH_TOKEN=env_token) if env_token else env()
    return subprocess.run([sys.executable, "-m", "distributed.client", *args], capture_output=True, text=True,
                          timeout=120, env=e, cwd=ROOT)
