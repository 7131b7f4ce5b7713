"""A torchrun job's ranks as the harness' group: ``TorchrunSession`` is this rank's process group,
the job's store and the outcome agreement of a body every rank runs at once, in-process. The
pytest plugin's torchrun mode (``torchrun --nproc-per-node N -m pytest ...``: every pytest process
is a rank) runs each distributed test's body through ``run_test``; the gate in a torchrun job runs
its cases through ``TorchrunPool`` (``torchrun_pool.py``) on the same session.

What makes a failing or hanging rank end *that test* instead of the session:

* The process group is created with the plugin's deadline as its timeout
  (``init_process_group(timeout=...)``) and, per test, set to that test's deadline
  (``distributed_c10d._set_pg_timeout``): a rank left waiting in a gloo collective whose peer
  raised before issuing it gets gloo's "Timed out waiting ... for recv" at the deadline instead
  of after torch's 30-minute default.
* Outcomes are agreed through the job's key-value store (``distributed_c10d._get_default_store``,
  the TCPStore torchrun's rendezvous made), with a timeout -- never through a collective, which
  would pair with a collective the test itself left pending on another rank.
* After a failed test every rank destroys the process group and creates a fresh one on a new
  store prefix (``PrefixStore("dpfsdp/pg<n>", store)``): a rank whose collective timed out has
  consumed a sequence number its peers did not, and the old group would pair the next test's
  collectives wrongly.

A rank stuck *outside* collectives (a Python loop, ``time.sleep``) cannot be freed from another
process: its peers report it ("rank 1 did not report within ... s") and end the test; later
distributed tests of the session fail at once naming it (use pytest-timeout for such hangs).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from datetime import timedelta
from typing import Any, Dict, List, Optional

from .rank_groups import grouped, ranks_phrase, were

#: Extra time a rank waits for its peers' outcomes beyond the test's deadline (a peer stuck in a
#: collective reports only once the process-group timeout has fired).
REPORT_GRACE_S = 10.0


def torchrun_env() -> Optional[tuple]:
    """``(rank, world_size)`` when this process is a torchrun rank, else ``None``."""
    if all(v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


class TorchrunSession:
    """This rank's process group, its store, and the outcome agreement of each test."""

    def __init__(self, rank: int, world_size: int, timeout: float, backend: Optional[str] = None):
        from .backends import get_backend, preferred_backend

        self.rank, self.world_size = rank, world_size
        self.backend = backend or preferred_backend()
        self.timeout = timeout
        self.generation = 0
        self.test_index = 0
        #: set when a rank never reported: the session's later distributed tests fail at once
        self.broken: Optional[str] = None
        import torch.distributed as dist

        get_backend(self.backend).setup_rank(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group(self.backend, timeout=timedelta(seconds=timeout))
        self.store = dist.distributed_c10d._get_default_store()

    # -- one test ----------------------------------------------------------------------
    def run_test(self, nodeid: str, body, deadline: float) -> Optional[str]:
        """Run ``body()`` on this rank and agree on the outcome with every rank; returns ``None``
        when every rank passed, ``"skip: <reason>"`` when every rank skipped, else the failure
        text (naming each failed or silent rank)."""
        import torch.distributed as dist

        self.test_index += 1
        if self.broken:
            return f"not run: {self.broken}"
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=deadline), None)
        t0 = time.monotonic()
        outcome: Dict[str, Any] = {"ok": True}
        try:
            body()
        except (KeyboardInterrupt, SystemExit):
            raise  # the user stops the session: not a test outcome
        except BaseException as e:  # noqa: B902 - incl. pytest.fail/skip: reported collectively
            outcome = {"ok": False, "type": type(e).__name__, "message": str(e),
                       "traceback": traceback.format_exc(), "seconds": time.monotonic() - t0,
                       "timeout": is_pg_timeout(e), "skipped": type(e).__name__ == "Skipped"}
        outcomes = self._agree(nodeid, outcome, max(0.0, deadline - (time.monotonic() - t0)) + REPORT_GRACE_S)
        failed = {r: o for r, o in outcomes.items() if o is not None and not o["ok"]}
        silent = sorted(r for r, o in outcomes.items() if o is None)
        if silent:
            self.broken = (f"{ranks_phrase(silent)} never reported an outcome of {nodeid} (stuck outside any "
                           "collective?); the process group cannot be renewed without them")
        elif failed:
            self.renew_group()
        if not failed and not silent:
            return None
        if not silent and len(failed) == self.world_size and all(o.get("skipped") for o in failed.values()):
            return "skip: " + failed[0]["message"]
        return _failure_text(failed, silent, deadline, outcomes)

    def _agree(self, nodeid: str, outcome: dict, wait_s: float) -> Dict[int, Optional[dict]]:
        """Post this rank's outcome under a per-test key and read every rank's; a rank that
        has not posted within ``wait_s`` maps to ``None``."""
        prefix = f"dpfsdp/outcome/{self.test_index}/{nodeid}/"
        self.store.set(prefix + str(self.rank), json.dumps(outcome))
        out: Dict[int, Optional[dict]] = {}
        deadline = time.monotonic() + wait_s
        for r in range(self.world_size):
            try:
                self.store.wait([prefix + str(r)], timedelta(seconds=max(0.1, deadline - time.monotonic())))
                out[r] = json.loads(self.store.get(prefix + str(r)))
            except Exception:  # the store's timeout: that rank never reported
                out[r] = None
        return out

    def renew_group(self) -> None:
        """A fresh process group on a new store prefix (see the module docstring)."""
        import torch.distributed as dist

        self.generation += 1
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"dpfsdp/pg{self.generation}", self.store),
                                rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=self.timeout))

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def is_pg_timeout(e: BaseException) -> bool:
    """Whether ``e`` is a collective that gave up at the process group's timeout (the rank waited
    for a peer), rather than a rank's own failure."""
    text = str(e)
    return "Timed out" in text or "timed out" in text or type(e).__name__ == "DistBackendError" and "timeout" in text


def _failure_text(failed: Dict[int, dict], silent: List[int], deadline: float, outcomes) -> str:
    """One line naming the rank(s) that failed first, then each rank's traceback."""
    # a rank that raised on its own is the culprit; ranks whose collective timed out waited for it
    culprits = [r for r, o in sorted(failed.items()) if not o.get("timeout")]
    waited = [r for r, o in sorted(failed.items()) if o.get("timeout")]
    # ranks that raised the same error are told once ("ranks 0-6: ValueError: ...")
    parts = [grouped({r: f"{failed[r]['type']}: {failed[r]['message']}" for r in culprits}, between=": ")] \
        if culprits else []
    if silent:
        parts.append(f"{ranks_phrase(silent)} did not report within {deadline:g} s + {REPORT_GRACE_S:g} s "
                     "(hung outside any collective?)")
    if waited:
        parts.append(f"{ranks_phrase(waited)} {were(waited)} left waiting in a collective until the {deadline:g} s "
                     "process-group timeout")
    head = "; ".join(parts)
    tb = "\n".join(f"--- rank {r} traceback ---\n{o['traceback']}" for r, o in sorted(failed.items()))
    return head + ("\n\n" + tb if tb else "")


__all__ = ["TorchrunSession", "torchrun_env", "is_pg_timeout", "REPORT_GRACE_S"]
