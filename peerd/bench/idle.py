"""`peerd bench idle`: what a serving daemon costs while nobody generates. Three daemons of the
default model (0:10, 10:20, 20:30, as the multi-process tests run them) start at the production
refresh period, are left to settle until their start-up work is over, then sit idle for a window
over which each one's CPU time (user + system, all its threads: /proc/PID/stat's utime + stime,
read through psutil) is divided by the wall time; its resident memory (VmRSS) is read at the end.

The daemons run as LocalSwarm starts them for the tests (one torch thread, a fixed announced
throughput, so no throughput measurement runs); what idles is the event loop, the DHT upkeep at
the refresh period and the connections between the three.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    import psutil

    from peerd.devtools.localswarm import DaemonProcess

# `peerd start --refresh-period`'s default (peerd/daemon/commands.py REFRESH_PERIOD; bench may not
# import daemon, tests/test_bench_idle.py holds the two equal): idle cost is paid at this period.
PRODUCTION_REFRESH_S = 60.0
# Issue 21: an idle daemon (serving, nobody generating) stays under 1% of a core.
TARGET_CPU_FRACTION = 0.01
# Long enough for the third daemon's joining, first announces and first info calls to be over.
SETTLE_S = 20.0
IDLE_S = 60.0
SPANS = (("a", "0:10"), ("b", "10:20"), ("c", "20:30"))


def run_idle_bench(
    *,
    idle_s: float = IDLE_S,
    settle_s: float = SETTLE_S,
    refresh_period: float = PRODUCTION_REFRESH_S,
    progress: bool = True,
) -> dict[str, Any]:
    """Start the three daemons, wait `settle_s`, measure each over `idle_s`, stop them."""
    from peerd.devtools.localswarm import LocalSwarm

    if idle_s <= 0 or settle_s < 0 or refresh_period <= 0:
        raise ValueError("--idle-s and --refresh-period must be positive, --settle-s at least 0")

    def say(line: str) -> None:
        if progress:
            print(f"[{line}]", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="peerd-bench-idle-") as workdir:
        swarm = LocalSwarm(Path(workdir), refresh_period=refresh_period)
        try:
            for name, blocks in SPANS:
                say(f"starting daemon {name} on blocks {blocks}")
                swarm.start(name, blocks)
            say(f"settling {settle_s:g} s")
            time.sleep(settle_s)
            say(f"idle window {idle_s:g} s")
            daemons = _measure_idle(swarm.daemons, idle_s)
        finally:
            swarm.stop()
    worst = max(d["cpu_fraction"] for d in daemons)
    return {
        "daemons": daemons,
        "max_cpu_fraction": worst,
        "target_cpu_fraction": TARGET_CPU_FRACTION,
        "within_target": all(d["cpu_fraction"] <= TARGET_CPU_FRACTION for d in daemons),
        "refresh_period_s": refresh_period,
        "idle_s": idle_s,
        "settle_s": settle_s,
    }


def _measure_idle(daemons: list[DaemonProcess], idle_s: float) -> list[dict[str, Any]]:
    """Each daemon's CPU seconds over the window per wall second, and its RSS at the end."""
    import psutil

    processes = {}
    for daemon in daemons:
        assert daemon.process is not None
        processes[daemon.name] = psutil.Process(daemon.process.pid)
    before = {name: (time.monotonic(), _cpu_s(p)) for name, p in processes.items()}
    time.sleep(idle_s)
    after = {name: (time.monotonic(), _cpu_s(p)) for name, p in processes.items()}
    report = []
    for daemon in daemons:
        assert daemon.process is not None
        if not daemon.alive():
            raise RuntimeError(
                f"daemon {daemon.name} exited while idle (exit {daemon.process.poll()}):\n"
                + daemon.log_path.read_text()[-3000:]
            )
        (t0, cpu0), (t1, cpu1) = before[daemon.name], after[daemon.name]
        span = daemon.span
        report.append(
            {
                "name": daemon.name,
                "blocks": f"{span[0]}:{span[1]}" if span else None,
                "cpu_fraction": round((cpu1 - cpu0) / (t1 - t0), 5),
                "rss_mb": round(processes[daemon.name].memory_info().rss / 2**20, 1),
            }
        )
    return report


def _cpu_s(process: psutil.Process) -> float:
    """CPU seconds the process has used, in user and kernel mode, over all its threads."""
    times = process.cpu_times()
    return float(times.user + times.system)


def format_idle_report(report: dict[str, Any]) -> str:
    lines = [
        f"{d['name']} (blocks {d['blocks']}): {100 * d['cpu_fraction']:.2f}% of a core, "
        f"{d['rss_mb']:.0f} MB resident"
        for d in report["daemons"]
    ]
    verdict = "within" if report["within_target"] else "OVER"
    lines.append(
        f"max {100 * report['max_cpu_fraction']:.2f}% of a core over {report['idle_s']:g} s idle "
        f"(settled {report['settle_s']:g} s, refresh period {report['refresh_period_s']:g} s): "
        f"{verdict} the target of {100 * report['target_cpu_fraction']:g}%"
    )
    return "\n".join(lines)


def bench_idle(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    idle_s: float = typer.Option(IDLE_S, "--idle-s", min=1.0, help="Seconds of idle measured."),
    settle_s: float = typer.Option(
        SETTLE_S, "--settle-s", min=0.0, help="Seconds after the last start before measuring."
    ),
    refresh_period: float = typer.Option(
        PRODUCTION_REFRESH_S, min=0.1, help="The daemons' --refresh-period (production: 60)."
    ),
) -> None:
    """Three local daemons left idle after they settle: each one's share of a core and its
    resident memory (`peerd bench idle`; cli.py registers it)."""
    try:
        report = run_idle_bench(idle_s=idle_s, settle_s=settle_s, refresh_period=refresh_period)
    except RuntimeError as e:
        typer.echo(f"peerd bench idle: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(report) if as_json else format_idle_report(report))
