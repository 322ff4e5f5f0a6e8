"""Where a machine's CPU seconds go, process by process, while something runs beside it (issue 29).

    python3 scripts/proc_cpu.py sample OUT.json [--interval-s 0.5]   # until SIGTERM or Ctrl-C
    python3 scripts/proc_cpu.py report OUT.json                      # CPU seconds by role

`sample` reads every process's user + system time from /proc each interval and keeps, per process,
the first and the last value seen, its command line (the last one: Ray workers rename themselves
`ray::ServeReplica:<app>:<deployment>` once they host a replica) and when it was seen. A process that
lived between two samples is missed, and one that ended counts what it had used at the last sample
before its end: the interval bounds both errors. `report` groups the processes by role (a Serve
replica by deployment, an engine process, Ray's own daemons, pytest) and prints, for each role, the
process count, the CPU seconds used while sampled, and the median and minimum per process. A process
seen in the first sample (it was there before) counts only what it used after it.
"""

import argparse
import collections
import json
import os
import re
import signal
import statistics
import time

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
# Roles by a fragment of the command line, first match wins; a Serve replica goes by its deployment.
# The pytest driver by "-m pytest": the tests' clients (lm-eval, aiperf, Prometheus) name files under
# /tmp/pytest-of-<user>.
ROLES = ("lanes.engine.process", "ServeController", "ProxyActor", "ShardWorker", "multiprocessing.spawn",
         "gcs_server", "raylet", "log_monitor", "DashboardAgent", "dashboard_agent", "RuntimeEnvAgent",
         "monitor.py", "ray::IDLE", "ray::_Holder", "-m pytest", "pip install", "prometheus", "loadtest", "aiperf",
         "lm_eval", "lm-eval")


def read_process(pid: str) -> tuple[float, float, str] | None:
    """(cpu_s, start ticks, command line) of one process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline") as f:
            cmdline = f.read().replace("\0", " ").strip()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # from field 3 (state) on: the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S, float(fields[19]), cmdline


def sample(out: str, interval_s: float) -> None:
    seen: dict[str, dict] = {}  # "pid:start" -> first/last cpu, cmdline, first/last seen (unix s)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    first_pass = True
    while not stop:
        now_s = time.time()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            read = read_process(pid)
            if read is None:
                continue
            cpu_s, start, cmdline = read
            proc = seen.setdefault(f"{pid}:{start:.0f}", {"pid": int(pid), "cpu0_s": 0.0 if not first_pass else cpu_s,
                                                          "first_s": now_s, "cmdline": cmdline})
            proc.update(cpu_s=cpu_s, last_s=now_s)
            if cmdline:  # a zombie's is empty: keep the last one it had
                proc["cmdline"] = cmdline
        first_pass = False
        time.sleep(interval_s)
    with open(out, "w") as f:
        json.dump(list(seen.values()), f)


def role(cmdline: str) -> str:
    replica = re.search(r"ServeReplica:[^: ]+:(\w+)", cmdline)
    if replica:
        return f"replica {replica.group(1)}"
    for fragment in ROLES:
        if fragment in cmdline:
            return fragment
    return "kernel or unnamed" if not cmdline else "other"


def report(path: str) -> None:
    with open(path) as f:
        procs = json.load(f)
    by_role: dict[str, list[float]] = collections.defaultdict(list)
    for proc in procs:
        by_role[role(proc["cmdline"])].append(proc["cpu_s"] - proc["cpu0_s"])
    window_s = max(p["last_s"] for p in procs) - min(p["first_s"] for p in procs)
    total_s = sum(map(sum, by_role.values()))
    print(f"{len(procs)} processes over {window_s:.0f} s of sampling, {total_s:.0f} CPU s in all")
    print(f"{'role':28s} {'count':>6s} {'CPU s':>8s} {'share':>6s} {'median':>7s} {'min':>6s}")
    for name, cpus in sorted(by_role.items(), key=lambda item: -sum(item[1])):
        print(f"{name:28s} {len(cpus):6d} {sum(cpus):8.1f} {sum(cpus) / total_s:6.1%} "
              f"{statistics.median(cpus):7.1f} {min(cpus):6.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sampling = sub.add_parser("sample", help="sample every process's CPU until SIGTERM or Ctrl-C")
    sampling.add_argument("out")
    sampling.add_argument("--interval-s", type=float, default=0.5)
    reporting = sub.add_parser("report", help="CPU seconds by role")
    reporting.add_argument("path")
    args = parser.parse_args()
    if args.command == "sample":
        sample(args.out, args.interval_s)
    else:
        report(args.path)


if __name__ == "__main__":
    main()
