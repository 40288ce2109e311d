"""Time to ready of ``folio serve`` (issue 31): cold (Numba's cache empty) and warm.

Each run starts ``folio serve --port 0`` on a private ZeroMQ socket, waits for its
``folio serve: ready on ...`` line, reads the CPU seconds that the server and its children (the
worker, the HTTP process, the kernel compile processes) have used by then (``/proc``, user +
system, live and reaped children), then stops it with SIGTERM. The first run starts with an empty
Numba cache, the next ones reuse what it left.

Where the cache lives (``--cache``):

* ``clone`` (default): a ``git clone`` of this repository's committed HEAD into a temporary
  folder, served from there (``PYTHONPATH``), with ``NUMBA_CACHE_DIR`` unset: Numba caches beside
  the clone's sources, as on a user's fresh clone;
* ``dir``: this checkout, with ``NUMBA_CACHE_DIR`` set to a new temporary folder.

The wall figures depend on what else runs on the machine: the script prints the load average and
the core count beside them, and the CPU seconds, which depend less on it.

    python perf/startup.py [--cache clone|dir] [--rev REV] [--warm-runs 1] [--model M] [-- extra serve args]

Measured (issue 31) on the 2-vCPU EPYC shared with other agents (load average 4.5-7 on 2 cores, so
the wall times are 1.5-2.5x what a quiet machine shows; the CPU seconds are the steadier figure),
``--rev e65debb`` (before) and ``--rev HEAD`` (after), default model, two sittings:

    before  cold 197.1 s / 132.7 CPU s (load 5.3)   379.1 s / 165.0 CPU s (load 7.0)
            warm 12.2 s / 7.1 CPU s (load 3.4)      20.0-26.4 s / 6.8-8.6 CPU s (load 6.4)
    after   cold 153.9 s / 74.7 CPU s (load 2.6)    130.6 s / 77.0 CPU s (load 4.5)
            warm 14.5 s / 10.9 CPU s (load 5.6)*    21.4-24.9 s / 8.7-9.8 CPU s (load 5.2-6.4)

(* before the cache check: two compile processes that loaded every kernel.) The cold start's
kernels now compile in two processes with a progress bar (``runtime/worker/precompile.py``);
the warm start spends ~1.3 CPU s more on the process that checks Numba's cache index, beside the
worker's model load.

Then (branch coldstart, 2026-12-03 18:02-18:05 UTC, same machine, one sitting, ``--cache clone
--warm-runs 2``, default model served from its Q4_1 GGUF, model home already imported): ``--rev
6620f9a`` (before: the layer loop's region linked its whole kernel tree, compiled four times over,
and lm_head compiled the product kernels in three more signatures) and ``--rev HEAD`` (after: the
regions call their item function by address, the int8 kernels only when asked for, one signature
per kernel; ``precompile``'s docstring lists the changes):

    after   cold 21.0 s / 37.7 CPU s (load 1.9)     warm 3.1 s / 5.1 CPU s, 3.1 s / 5.2 CPU s
    before  cold 67.4 s / 72.0 CPU s (load 2.2)     warm 5.0 s / 5.2 CPU s, 5.0 s / 5.2 CPU s (load 3.6)
    after   cold 39.6 s / 39.8 CPU s (load 3.8)     warm 4.8 s / 5.0 CPU s, 4.8 s / 5.0 CPU s (load 4.0)

The kernels' compile itself: 18.7 s (after, load 1.9), 63.9 s (before), 35.6 s (after, load 3.8).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TICK = os.sysconf("SC_CLK_TCK")


def _tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and all its descendants, live ones and reaped ones
    (``/proc/PID/stat`` fields utime, stime, cutime, cstime)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        p = int(name)
        stats[p] = fields
        children.setdefault(int(fields[1]), []).append(p)   # fields[1]: ppid
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        f = stats.get(p)
        if f is None:
            continue
        total += sum(int(x) for x in f[11:15])               # utime stime cutime cstime
        todo += children.get(p, [])
    return total / _TICK


def time_to_ready(cmd: list[str], env: dict, cwd: str, timeout: float) -> tuple[float, float, str]:
    """Start ``cmd``; returns (wall seconds to the ready line, CPU seconds of its process tree
    then, the output up to it). Raises RuntimeError if it exits or times out before."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    lines = []
    try:
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"exited ({proc.wait()}) before ready:\n" + "".join(lines[-40:]))
            lines.append(line)
            sys.stdout.write("    | " + line)
            if "ready on" in line:
                wall = time.monotonic() - t0
                return wall, _tree_cpu_seconds(proc.pid), "".join(lines)
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"not ready after {timeout} s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", choices=["clone", "dir"], default="clone")
    p.add_argument("--warm-runs", type=int, default=1)
    p.add_argument("--rev", default="HEAD", help="with --cache clone: the commit to check out (before/after)")
    p.add_argument("--model", default=None)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for one ready line")
    p.add_argument("serve_args", nargs="*", help="more arguments for folio serve (after --)")
    a = p.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="folio-startup-")
    env = dict(os.environ)
    try:
        if a.cache == "clone":
            cwd = os.path.join(tmp, "clone")
            subprocess.run(["git", "clone", "--quiet", ROOT, cwd], check=True)
            subprocess.run(["git", "checkout", "--quiet", a.rev], cwd=cwd, check=True)
            rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True,
                                 text=True).stdout.strip()
            env.pop("NUMBA_CACHE_DIR", None)
            env["PYTHONPATH"] = cwd + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            where = f"a fresh clone of {rev} in {cwd} (Numba caches beside its sources)"
        else:
            cwd = ROOT
            env["NUMBA_CACHE_DIR"] = os.path.join(tmp, "numba-cache")
            where = f"this checkout, NUMBA_CACHE_DIR={env['NUMBA_CACHE_DIR']} (empty at first)"
        origin = subprocess.run([sys.executable, "-c", "import folio, os; print(os.path.dirname(folio.__file__))"],
                                env=env, cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
        if os.path.realpath(os.path.dirname(origin)) != os.path.realpath(cwd):
            raise SystemExit(f"folio imports from {origin}, not from {cwd}")
        cmd = [sys.executable, "-m", "folio", "serve", "--port", "0",
               "--address", "ipc://" + os.path.join(tmp, "zmq.sock")]
        if a.model:
            cmd += ["--model", a.model]
        cmd += a.serve_args
        print(f"serving from {where}\ncommand: {shlex.join(cmd)}")
        results = []
        for i in range(1 + a.warm_runs):
            kind = "cold" if i == 0 else "warm"
            load = os.getloadavg()[0]
            print(f"{kind} run (load average {load:.2f}, {os.cpu_count()} cores) ...", flush=True)
            wall, cpu, _ = time_to_ready(cmd, env, cwd, a.timeout)
            results.append((kind, wall, cpu, load))
        print(f"\n{'run':6} {'ready (s)':>10} {'CPU s':>8} {'load avg':>9}")
        for kind, wall, cpu, load in results:
            print(f"{kind:6} {wall:10.1f} {cpu:8.1f} {load:9.2f}")
        print(f"({os.cpu_count()} cores; CPU s: user + system of folio serve and its children until ready)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
