#!/usr/bin/env python3
"""Counts one lane's specs in a Ginkgo JSON report: `count.py REPORT LABEL`.

Prints `PASSED FAILED SKIPPED` and then one `FAILED <spec>` / `SKIPPED <spec>` line per spec so.
Only specs carrying LABEL (on the It or a container) count: Ginkgo reports the specs the label
filter left out as skipped too, and those belong to other lanes. Failed includes panicked,
interrupted, aborted and timed-out specs; skipped includes pending ones and those an Ordered
container skipped after an earlier failure.
"""

import json
import sys

report_path, label = sys.argv[1], sys.argv[2]
try:
    with open(report_path, encoding="utf-8") as f:
        suites = json.load(f)
except (OSError, ValueError) as e:
    print(f"0 0 0\nERROR no readable report {report_path}: {e}")
    sys.exit(0)

passed = failed = skipped = 0
notes = []
for suite in suites:
    for spec in suite.get("SpecReports") or []:
        if spec.get("LeafNodeType") != "It":
            continue
        labels = set(spec.get("LeafNodeLabels") or [])
        for level in spec.get("ContainerHierarchyLabels") or []:
            labels.update(level or [])
        if label not in labels:
            continue
        name = " ".join((spec.get("ContainerHierarchyTexts") or []) + [spec.get("LeafNodeText", "")])
        state = spec.get("State")
        if state == "passed":
            passed += 1
        elif state in ("skipped", "pending"):
            skipped += 1
            notes.append(f"SKIPPED {name}")
        else:
            failed += 1
            notes.append(f"FAILED  {name} ({state})")
print(passed, failed, skipped)
for n in notes:
    print(n)
