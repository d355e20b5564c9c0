"""A rank's command held at a gate the test opens: `python ring_gate.py GATE COMMAND…` waits while
the file GATE is missing, then becomes `python COMMAND…` (exec: the same process, so the launcher's
signals and its watch of the rank are the real ones). What tests/launch/test_router_queue.py starts
its ranks with: while the gate is shut, a restarted ring stays down for as long as the test acts,
however slow the machine, with no restart delay to wait out afterwards."""

import os
import sys
import time

if __name__ == "__main__":
    gate, command = sys.argv[1], sys.argv[2:]
    while not os.path.exists(gate):
        time.sleep(0.05)
    os.execv(sys.executable, [sys.executable, *command])
