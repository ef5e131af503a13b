"""Ending a run at a step boundary: SIGTERM and SIGINT, and `train.max_seconds`, agreed by every
process.

A cluster preempts a job with SIGTERM, then SIGKILL after a grace period; a user stops one with
Ctrl-C (SIGINT). While `StopSignals` is active, either signal only records that a stop was asked
for; the loop finishes the step it is in, saves a checkpoint and writes its summary. A second
signal ends the process at once, the default way.

Every process must stop after the same step, or the ones still training would wait forever in the
next step's collectives for the ones that left. The signal may reach one process (a `kill` of one
trainer) or all of them at different steps, so each step boundary agrees by one all-gather of a
tiny flag over the processes (`agree`); a single process needs none. JAX's own preemption notifier
(installed by `jax.distributed.initialize`, SIGTERM only, read through
`multihost_utils.reached_preemption_sync_point`) is replaced by these handlers while the loop
runs: one mechanism serves both signals and any process count.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
  """Context manager: SIGTERM / SIGINT set `signum` instead of ending the process.

  Outside the main thread (where Python cannot install handlers) it does nothing.
  """

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, object] = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for sig in SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, previous in self._previous.items():
      # A handler installed outside Python (JAX's preemption notifier) reads back as None and
      # cannot be reinstalled: the default action takes its place.
      signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
    self._previous.clear()

  def _handle(self, signum, frame) -> None:
    if self.signum is not None:  # asked twice: stop now
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    self.signum = signum
    # os.write, not print: a handler that runs while the main thread prints must not re-enter
    # the stream's buffer.
    os.write(2, f"received {signal.Signals(signum).name}: stopping after this step and saving a "
                f"checkpoint (send it again to stop at once)\n".encode())


def agree(signals: StopSignals, run_start: float, max_seconds: float | None) -> tuple[int | None, bool]:
  """(the signal any process received, or None; whether process 0's clock passed `max_seconds`):
  the same answer on every process. A collective when there are several processes: every process
  calls it at every step boundary."""
  import jax

  out_of_time = max_seconds is not None and time.perf_counter() - run_start > max_seconds
  if jax.process_count() == 1:
    return signals.signum, out_of_time
  from jax.experimental import multihost_utils

  mine = np.asarray([signals.signum or 0, int(out_of_time)], np.int32)
  every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
  signum = int(every[:, 0].max())
  return (signum or None), bool(every[0, 1])


def signal_name(signum: int | None) -> str | None:
  """"SIGTERM" for 15; None for None."""
  return signal.Signals(signum).name if signum else None


def exit_code(signame: str | None) -> int:
  """The exit status of a run stopped by `signame` ("SIGTERM": 143), as a shell reports a process
  that signal ended: 128 + its number. 0 when not stopped."""
  return 128 + int(signal.Signals[signame]) if signame else 0
