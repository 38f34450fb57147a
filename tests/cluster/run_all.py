"""``make cluster``: every fault of ``tests/cluster/scenario.py``, without and with a standby replica,
each on a cluster of its own; the report (fault, takeover s, lost, duplicated, unequal, p99 before,
during and after) goes to ``out/cluster/report.json`` and ``report.md``. Exits 1 when a fault lost
or duplicated an event, changed a state, or took 15 s or more to move."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tests.cluster.netns import Network, unavailable
from tests.cluster.scenario import FAULTS, Report, Shape, as_dict, run_fault


def table(reports: list[Report]) -> str:
    lines = [
        "| fault | standby | takeover s | resumed s | events | lost | duplicated | unequal"
        " | p99 ms before / during / after | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        p = r.p99_ms
        lines.append(
            f"| {r.fault} | {r.standby} | {r.takeover_s:.1f} | {r.resumed_s:.1f} | {r.events} | {r.lost}"
            f" | {r.duplicated} | {r.unequal}"
            f" | {p['before']:.0f} / {p['during']:.0f} / {p['after']:.0f} | {'ok' if r.ok() else 'FAILED'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="out/cluster")
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--standby", nargs="*", type=int, default=[0, 1])
    parser.add_argument(
        "--seconds", type=float, default=Shape.seconds, help="the most events are produced for"
    )
    parser.add_argument("--rate", type=int, default=500)
    args = parser.parse_args()
    why = unavailable()
    if why is not None:
        print(f"cluster scenarios need network namespaces: {why}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports: list[Report] = []
    for fault in args.faults:
        for standby in args.standby:
            shape = Shape(standby=standby, seconds=args.seconds, rate=args.rate)
            started = time.monotonic()
            with Network() as net:
                report = run_fault(net, out / f"{fault}-standby{standby}", fault, shape)
            reports.append(report)
            took = time.monotonic() - started
            print(f"{fault} standby={standby}: {json.dumps(as_dict(report))} ({took:.0f} s)", flush=True)
            (out / "report.json").write_text(json.dumps([as_dict(r) for r in reports], indent=2))
            (out / "report.md").write_text(table(reports))
    return 0 if all(r.ok() for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
