"""The launcher's router: `launch run … --serve` serves gRPC (and --http) from the
launcher's process, in front of rank 0, so that clients keep their endpoint while the
ring fails and restarts.

It hosts the same front ends as rank 0 (distributed/serving: gRPC with health and
reflection, the OpenAI HTTP API, auth, the access log and metrics), attached to a
RemoteScheduler instead of the runtime's. They listen at once (NOT_SERVING) and
attach once rank 0 first serves (its GetModelInfo gives the model facts; the
tokenizer is loaded here from the model the ranks load). While the ring is down
health is NOT_SERVING and requests wait (replay.py); when rank 0 serves again they
are replayed. The Supervisor (launch/supervisor.py) tells it when it gives up or
stops: then what is held fails with that reason.

One line per outage on stderr (the pause each request saw is logged as it resumes):
    launch: router: ring back after 5.3 s (rank 0 serving again); replaying 3 requests
"""

import logging
import statistics
import threading
from dataclasses import replace
from typing import List, Optional

import grpc

from distributed.serving.front_ends import start_front_ends
from distributed.serving.metrics import Metrics
from distributed.serving.request_log import RequestLog
from distributed.serving.chat_format import ModelInfo

from ..hostfile import Hostfile
from .command import RouterPlan, serve_on_first_host
from .remote_scheduler import RemoteScheduler, rank_rows
from .replay import Forwarded
from .upstream import Upstream


def log(message: str) -> None:
    logging.getLogger("launch.router").info(f"launch: router: {message}")


class Router:
    def __init__(self, plan: RouterPlan, model: Optional[str]):
        self.plan, self.model = plan, model
        self.requests = RequestLog(Metrics())
        self.front_ends = start_front_ends(plan.options, self.requests)
        self.upstream = Upstream(plan.upstream, plan.token, on_up=self._on_up, on_down=self._on_down)
        self.scheduler: Optional[RemoteScheduler] = None
        self.tokenizer = self.info = None
        self.pauses: List[float] = []  # per replayed request: seconds from its failure to its next token
        self.outages = 0
        self._attached = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._stop_thread: Optional[threading.Thread] = None
        self._loader = threading.Thread(target=self._load_tokenizer, name="router-tokenizer", daemon=True)

    def start(self) -> "Router":
        self._loader.start()
        self.upstream.start()
        return self

    def _load_tokenizer(self) -> None:
        from distributed.shard.checkpoint import load_config  # imports mlx_lm: off the main thread
        from mlx_lm.utils import load_tokenizer

        _, path, config = load_config(self.model)
        self.tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))

    def _on_up(self, epoch: int, down_for: Optional[float]) -> None:
        if epoch == 1:
            return threading.Thread(target=self._attach, name="router-attach", daemon=True).start()
        m = self.requests.metrics
        m.restarts, m.ring_failed = self.outages, False  # every outage so far ended in a restart
        if self._attached.is_set():
            self._refresh(epoch)
            self._serving()
        # Streams the failure cut (not those that only waited, which may have started by now).
        cut = sum(1 for f in self.scheduler.held() if f.replays) if self.scheduler else 0
        log(f"ring back after {down_for:.1f} s (rank 0 serving again); replaying {cut} requests")

    def _attach(self) -> None:
        """Rank 0 serves for the first time: the model facts, then SERVING."""
        self._loader.join()
        if self.tokenizer is None:
            return self.give_up("the router could not load the tokenizer")
        try:
            m = self.upstream.model_info()
        except grpc.RpcError as e:  # it failed meanwhile: the next epoch retries
            log(f"rank 0's GetModelInfo failed ({e.code().name}: {e.details()}); waiting for it")
            self.upstream.failed(self.upstream.epoch, e.details() or "")
            return self._retry_attach()
        self.info = model_facts(m)
        tokenizer = self.tokenizer
        self.scheduler = RemoteScheduler(self.upstream, lambda ids: tokenizer.decode(ids),
                                         self.plan.options.max_queue, m.max_batch, on_replay=self._replayed)
        self.requests.metrics.attach(self.scheduler, self.info)
        self._attached.set()
        if self.upstream.serving and self.upstream.closed is None:
            self._serving()
        print(f"serving {self.info.model_id} on " + " and ".join(f.describe() for f in self.front_ends)
              + f" (router; rank 0 at {self.plan.upstream})", flush=True)

    def _retry_attach(self) -> None:
        try:
            self.upstream.wait_serving(lambda: False)
        except Exception as e:  # closed while waiting (the launcher stopped): nothing to attach
            logging.getLogger(__name__).info("router: not attaching: %s: %s", type(e).__name__, e)
            return
        self._attach()

    def _refresh(self, epoch: int) -> None:
        """The restarted rank 0's facts: its max batch (our bound) and rank map may have changed."""
        try:
            m = self.upstream.model_info(timeout=5)
        except grpc.RpcError as e:  # the old ones meanwhile: the next restart asks again
            return log(f"rank 0's GetModelInfo failed ({e.code().name}: {e.details()}); keeping its earlier facts")
        if self.upstream.epoch == epoch:
            self.info = model_facts(m)
            self.scheduler.set_max_batch(m.max_batch)
            self.requests.metrics.attach(self.scheduler, self.info)

    def _serving(self) -> None:
        with self._stop_lock:
            if self._stopped or self.upstream.closed is not None or not self.upstream.serving:
                return
            for front_end in self.front_ends:
                front_end.attach(self.scheduler, self.tokenizer, self.info)

    def _on_down(self, reason: str) -> None:
        self.outages += 1
        m = self.requests.metrics
        m.restarts, m.ring_failed = self.outages - 1, True  # ring_failures counts this one
        if not self._attached.is_set():
            return
        with self._stop_lock:
            if self._stopped or self.upstream.closed is not None:
                return
            for front_end in self.front_ends:
                front_end.set_recovering(reason)
        log(f"rank 0 is down ({reason}); requests wait for the ring to restart")

    def _replayed(self, forwarded: Forwarded, paused: float) -> None:
        self.pauses.append(paused)
        log(f"replayed a request after {paused:.1f} s ({len(forwarded.tokens)} tokens already streamed)")

    def rebind(self, hostfile: Hostfile, command: List[str]) -> List[str]:
        """The ranks' command with rank 0's internal --serve on a fresh port of hostfile's first
        host, which the router calls from now on: before a restart (the port let go of may be
        taken meanwhile) and when re-planning dropped rank 0's host (launch/replan.py)."""
        command, upstream = serve_on_first_host(command, hostfile)
        self.plan = replace(self.plan, upstream=upstream, command=command)
        self.upstream.retarget(upstream)
        log(f"rank 0 on {hostfile.hosts[0].ssh} is called at {upstream}")
        return command

    # Called by the Supervisor.

    def give_up(self, reason: str) -> None:
        """No restarts left: what is held fails with `reason`; health stays NOT_SERVING."""
        with self._stop_lock:
            for front_end in self.front_ends:
                front_end.set_not_serving(reason)
        if self.scheduler is not None:
            self.scheduler.close(reason)
        self.upstream.close(reason)

    def stopping(self) -> None:
        """A stop signal reached the launcher (called from the signal handler: no waiting)."""
        self.upstream.close("the server is shutting down")
        if self._stop_thread is None:
            self._stop_thread = threading.Thread(target=self.stop, args=("stopped by a signal",), name="router-stop",
                                                 daemon=True)
            self._stop_thread.start()

    def stop(self, why: str = "stopped") -> None:
        """Stop the front ends (in-flight streams get their STOP_GRACE_S) and log the stop line."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        if self.scheduler is not None:
            self.scheduler.close("the server is shutting down")
        self.upstream.close("the server is shutting down")
        for front_end in self.front_ends:
            front_end.stop()
        self.upstream.shut()
        if self.pauses:
            log(f"{len(self.pauses)} requests replayed over {self.outages} outages; pause median "
                f"{statistics.median(self.pauses):.1f} s, worst {max(self.pauses):.1f} s")
        self.requests.stopped(why)


    def close(self) -> None:
        """After the supervisor returned: stop (unless a signal's thread does) and wait for it."""
        if self._stop_thread is not None:
            self._stop_thread.join(timeout=15)
        else:
            self.stop()


def model_facts(m) -> ModelInfo:
    """Rank 0's GetModelInfo (pb.ModelInfo) as the front ends' ModelInfo."""
    return ModelInfo(model_id=m.model_id, vocab_size=m.vocab_size, max_context=m.max_context,
                     max_tokens_cap=m.max_tokens_cap, ranks=rank_rows(m), max_batch=m.max_batch,
                     kv_bits=m.kv_bits or None)
