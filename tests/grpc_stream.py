"""A Generate stream on a thread, for tests that disturb the server while it runs
(tests/launch/test_router.py, test_router_replan.py)."""

import threading
import time

import grpc

from distributed.serving.proto import generation_pb2 as pb


class Stream(threading.Thread):
    """One Generate on a thread: its tokens as they come, then its end (or its error)."""

    def __init__(self, stub, **fields):
        super().__init__(daemon=True)
        self.stub, self.fields = stub, fields
        self.tokens, self.logprobs, self.text = [], [], ""
        self.arrivals = []  # time.monotonic() of each response
        self.finish = self.usage = self.error = None
        self.start()

    def run(self):
        try:
            for r in self.stub.Generate(pb.GenerateRequest(**self.fields), timeout=300):
                self.arrivals.append(time.monotonic())
                self.tokens += r.token_ids
                self.logprobs += r.logprobs
                self.text += r.text
                if r.finish_reason:
                    self.finish, self.usage = r.finish_reason, (r.usage.prompt_tokens, r.usage.completion_tokens)
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"

    def wait_tokens(self, n, timeout=120):
        end = time.monotonic() + timeout
        while len(self.tokens) < n and self.is_alive() and time.monotonic() < end:
            time.sleep(0.01)
        assert len(self.tokens) >= n, (self.error, len(self.tokens))

    def result(self, timeout=300):
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        assert self.error is None, self.error
        return self.tokens, self.text, self.finish, self.usage
