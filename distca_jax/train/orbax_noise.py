"""What orbax prints when a damaged checkpoint is read, kept out of a run's output.

A failed restore is reported in one line by `checkpoint.Checkpointer`; the asyncio machinery
under orbax and tensorstore then reports the same failure again, many times, with tracebacks.
"""

from __future__ import annotations

import logging
import sys


class _NoOrbaxTracebacks(logging.Filter):
  """Keeps the message of an orbax error log and drops its traceback: the failures it reports
  reach the caller as one-line CheckpointErrors (with the cause chained), where a failed save
  otherwise printed some seventy lines of orbax's threads' stacks first."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.getMessage().startswith("Given directory is read only"):
      return False  # what read_only asked for (resume reads before the run may write)
    if record.exc_info and "orbax" in record.pathname:
      record.exc_info, record.exc_text = None, None
    return True



logging.getLogger("absl").addFilter(_NoOrbaxTracebacks())


class ClosedLoopNoiseDropped:
  """Context: drops from sys.stderr the tracebacks of `RuntimeError: Event loop is closed`.

  When a read of a damaged checkpoint fails, orbax closes the event loop of that restore while
  tensorstore still completes the step's other reads; each completion then tries to schedule its
  callback on the closed loop and prints that error's traceback (dozens, interleaved across
  threads, piece by piece). Nothing is lost with them: the failure itself is reported. Only the
  pieces of those tracebacks are dropped, and only while the context is active.
  """

  NOISE = ("Traceback (most recent call last)", "asyncio/base_events.py", "_check_closed()",
           "Event loop is closed", "RuntimeError")

  def __enter__(self):
    self._stderr, sys.stderr = sys.stderr, self
    return self

  def __exit__(self, *exc) -> None:
    sys.stderr = self._stderr

  def write(self, text: str) -> int:
    if text.strip(" :\t\n") and not any(piece in text for piece in self.NOISE):
      return self._stderr.write(text)
    return len(text)

  def __getattr__(self, name):  # flush, fileno, encoding, ...: the real stream's
    return getattr(self._stderr, name)


def drop_orphaned_read_errors() -> None:
  """After a failed read of a damaged checkpoint, the restore's other reads end as asyncio tasks
  whose errors nobody awaits; asyncio logs each with its traceback when the task is collected,
  possibly long after the restore (at exit). The failure is reported already: those records
  are dropped from the `asyncio` logger for the rest of the process."""
  logger = logging.getLogger("asyncio")
  if _orphaned_read_error not in logger.filters:
    logger.addFilter(_orphaned_read_error)


def _orphaned_read_error(record: logging.LogRecord) -> bool:
  """False (drop) for asyncio's report of a task's error nobody retrieved."""
  return not record.getMessage().startswith("Task exception was never retrieved")
