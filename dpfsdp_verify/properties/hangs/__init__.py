"""Hangs, one topic: ``check`` is ``deadlock_free`` (every run finishes under the watchdog: uneven and
empty local batches, Poisson sampling, accumulation; a hang is a proven deadlock or a named
timeout)."""
