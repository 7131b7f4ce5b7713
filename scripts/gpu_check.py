#!/usr/bin/env python3
"""The GPU check anyone can rerun (docs/gpu.md): the gate on a GPU machine, as its users run it.

Three runs of ``python -m dpfsdp_verify run --expect opacus-1.6.0``, each with a JSON report:

* ``gloo``: the default gate with the GPUs visible -- it must give the CPU machine's verdicts
  (gloo ranks compute on the CPU whatever the machine has);
* ``nccl``: the default gate at the world sizes the GPUs allow (1 on one GPU, 1,2 on two or more);
* ``nccl-bf16``: one bf16 precision (``--precisions bf16-autocast``) on nccl.

Each run is planned first (the gate's ``--dry-run``: options checked, nothing started), all of
them before the first starts, so a run the machine cannot make fails in seconds, not after the
others (``--plan`` stops there). The default gate's 3-rank cases need 3 GPUs under nccl: on fewer
they are ``skip`` verdicts saying so, and the rest runs.

then one table, property x run: pass / fail / hang / error / skip counts (``(n exp)``: how many
of the failures ``--expect`` accepted), the run's exit code and wall time, with the card, torch
and CUDA versions above it. Exit 0 iff every run exited 0.

Needs torch with CUDA (without a GPU only the gloo run happens, and the table says so); pytest
and hypothesis are not needed; opacus may be missing: ``--wheels DIR`` installs every wheel in
DIR (``opacus-*.whl``, and scipy / opt-einsum wheels if the machine lacks them) with ``pip install
--no-index --no-deps`` into a temporary directory put on ``PYTHONPATH`` (no network). Runs from
the repository checkout without installing it (the checkout goes on ``PYTHONPATH`` too)::

    python scripts/gpu_check.py --wheels /path/to/wheels [--out gpu-check.md] [--plan] [-- EXTRA GATE ARGS]

Arguments after ``--`` go to every run (e.g. ``-- --properties norm_fidelity`` for a short check).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATUSES = ("pass", "fail", "hang", "error", "skip")


def _environment(extra_path: List[str]) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, *extra_path] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _has_opacus(env: Dict[str, str]) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import opacus"], env=env, capture_output=True)
    return probe.returncode == 0


def install_opacus(wheels: str, into: str) -> None:
    """``pip install --no-index --no-deps`` of every wheel in ``wheels`` (opacus', and any of its
    dependencies the machine lacks: scipy, opt-einsum) into ``into``; ``SystemExit`` (one line)
    when there is no opacus wheel or pip fails."""
    found = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if not any(os.path.basename(w).startswith("opacus-") for w in found):
        raise SystemExit(f"gpu_check: no opacus-*.whl in {wheels} (hint: `pip download --no-deps opacus==1.6.0 -d "
                         f"{wheels}` on a machine with network)")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                           "--target", into, *found], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"gpu_check: pip could not install the wheels of {wheels}: "
                         f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")


def machine() -> Dict[str, str]:
    """Card, GPU count, torch and CUDA versions, as this process's torch sees them (the count as the
    gate plans with it: ``harness.backends.visible_gpus``)."""
    import torch

    sys.path.insert(0, REPO)
    from dpfsdp_verify.harness.backends import visible_gpus

    n = visible_gpus()
    name = (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "simulated GPU") if n else "no GPU"
    return {"card": name, "gpus": str(n), "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def planned_runs(gpus: int) -> List[Tuple[str, List[str]]]:
    """``(name, gate arguments)`` of each run this machine allows (module docstring)."""
    runs = [("gloo", ["--backend", "gloo"])]
    if gpus:
        sizes = "1" if gpus == 1 else "1,2"
        runs += [("nccl", ["--backend", "nccl", "--world-sizes", sizes]),
                 ("nccl-bf16", ["--backend", "nccl", "--world-sizes", sizes, "--precisions", "bf16-autocast"])]
    return runs


def plan_gate(name: str, args: List[str], extra: List[str], env: Dict[str, str]) -> Tuple[int, str]:
    """The run's plan (``run --dry-run``): ``(exit code, its output)``; 0 when it would run."""
    cmd = [sys.executable, "-m", "dpfsdp_verify", "run", "--expect", "opacus-1.6.0", "--dry-run", *args, *extra]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    return done.returncode, (done.stdout + done.stderr).strip()


def run_gate(name: str, args: List[str], extra: List[str], env: Dict[str, str], workdir: str,
             timeout: float) -> Dict[str, object]:
    """One gate run: ``{"name", "code", "seconds", "counts": {property: {status: n, "expected": n}}}``."""
    report = os.path.join(workdir, f"{name}.json")
    cmd = [sys.executable, "-m", "dpfsdp_verify", "run", "--expect", "opacus-1.6.0", "--quiet", "--json", report,
           *args, *extra]
    print(f"gpu_check: {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    log = os.path.join(workdir, f"{name}.log")
    t0 = time.monotonic()
    with open(log, "w") as out:  # the gate's own summary stays out of the table; shown when it failed
        try:
            code = subprocess.run(cmd, env=env, cwd=REPO, timeout=timeout, stdout=out, stderr=subprocess.STDOUT
                                  ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    seconds = time.monotonic() - t0
    if code != 0:
        with open(log) as f:
            tail = f.read().splitlines()[-15:]
        print(f"gpu_check: {name} exited {code}; the end of its output:", *tail, sep="\n", file=sys.stderr)
    counts: Dict[str, Dict[str, int]] = {}
    if os.path.exists(report):
        with open(report) as f:
            for v in json.load(f)["results"]:
                c = counts.setdefault(v["property"], {s: 0 for s in STATUSES + ("expected",)})
                c[v["status"]] += 1
                c["expected"] += bool(v.get("expected"))
    return {"name": name, "code": code, "seconds": seconds, "counts": counts}


def table(info: Dict[str, str], runs: List[Dict[str, object]], skipped: Optional[str]) -> str:
    """The markdown table (module docstring)."""
    lines = [f"GPU check {info['date']}: {info['card']} x{info['gpus']}, torch {info['torch']}, CUDA {info['cuda']}",
             "", "| property | " + " | ".join(str(r["name"]) for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    properties = list(dict.fromkeys(p for r in runs for p in r["counts"]))
    for p in properties:
        cells = []
        for r in runs:
            c = r["counts"].get(p)
            if not c:
                cells.append("-")
                continue
            cell = " ".join(f"{c[s]} {s}" for s in STATUSES if c[s])
            cells.append(cell + (f" ({c['expected']} exp)" if c["expected"] else ""))
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines.append("| **exit code** | " + " | ".join(str(r["code"]) for r in runs) + " |")
    lines.append("| **wall time** | " + " | ".join(f"{r['seconds']:.0f} s" for r in runs) + " |")
    if skipped:
        lines += ["", skipped]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheels", help="directory holding opacus-*.whl, installed if opacus is not importable")
    p.add_argument("--out", help="also write the table (markdown) here")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per gate run (default 1800)")
    p.add_argument("--reports", help="keep each run's JSON report and log in this directory (default: discarded)")
    p.add_argument("--plan", action="store_true", help="only plan the runs (the gate's --dry-run) and print the plans")
    args = p.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="dpfsdp-gpu-check-")
    reports = args.reports or workdir
    os.makedirs(reports, exist_ok=True)
    try:
        env = _environment([])
        if not _has_opacus(env):
            if not args.wheels:
                raise SystemExit("gpu_check: opacus is not importable (hint: --wheels DIR with opacus-*.whl)")
            target = os.path.join(workdir, "site")
            install_opacus(args.wheels, target)
            env = _environment([target])
            if not _has_opacus(env):
                raise SystemExit(f"gpu_check: opacus installed into {target} but still not importable")
        info = machine()
        planned = planned_runs(int(info["gpus"]))
        bad = 0
        for name, gate_args in planned:
            code, text = plan_gate(name, gate_args, extra, env)
            if args.plan or code:
                print(f"gpu_check: {name} plan (exit {code}):", text, sep="\n", file=sys.stderr)
            bad += code != 0
        if bad or args.plan:
            return 1 if bad else 0
        runs = [run_gate(name, gate_args, extra, env, reports, args.timeout) for name, gate_args in planned]
        skipped = None if int(info["gpus"]) else "no GPU visible: the nccl and bf16 runs were not made"
        out = table(info, runs, skipped)
        print(out)
        if args.out:
            with open(args.out, "w") as f:
                f.write(out + "\n")
        return 0 if all(r["code"] == 0 for r in runs) else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
