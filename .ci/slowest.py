"""Prints the slowest tests of the JUnit XML files in a folder (CI's time budget at a glance).

Usage: python .ci/slowest.py DIR [N]
"""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main() -> None:
    folder, n = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 25
    rows: list[tuple[float, str, str]] = []
    for xml in sorted(folder.glob("*.xml")):
        for case in ET.parse(xml).iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            rows.append((float(case.get("time", 0) or 0), xml.stem, name))
    totals: dict[str, float] = {}
    for t, run, _ in rows:
        totals[run] = totals.get(run, 0.0) + t
    print("test time per pytest run: " + ", ".join(f"{k} {v:.0f}s" for k, v in totals.items()))
    for t, run, name in sorted(rows, reverse=True)[:n]:
        print(f"    {t:7.1f}s  {run:<16} {name}")


if __name__ == "__main__":
    main()
