"""CI's closing lines: how many C++ (ctest) and Python (pytest) tests ran, passed, failed, and were skipped
for want of a GPU, from their JUnit reports. Exit status 1 when a test failed, when nothing ran, or when a
test was skipped for another reason than a missing GPU (on CI every other requirement is installed, so
such a skip means a test silently stopped running).

    python3 .ci/summary.py CTEST_JUNIT PYTEST_JUNIT
"""

import re
import sys
import xml.etree.ElementTree as ET

# What the suites say when a test needs a GPU this machine lacks.
GPU_REASON = re.compile(r"CUDA|GPU|built without CUDA", re.IGNORECASE)


def cases(path):
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for suite in suites:
        yield from suite.iter("testcase")


def ctest_skip_reason(case):
    # GoogleTest prints "file:line: Skipped" and then the GTEST_SKIP message.
    out = case.findtext("system-out") or ""
    m = re.search(r": Skipped\n([^\n]*)", out)
    return m.group(1).strip() if m else "(no reason printed)"


def pytest_skip_reason(case):
    skipped = case.find("skipped")
    return skipped.get("message", "") or (skipped.text or "").strip()


def count(path, skip_reason):
    result = dict(ran=0, passed=0, failed=0, gpu_skipped=0, other_skipped=[])
    for case in cases(path):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        result["ran"] += 1
        if case.find("failure") is not None or case.find("error") is not None or case.get("status") == "fail":
            result["failed"] += 1
        elif case.find("skipped") is not None:
            reason = skip_reason(case)
            if GPU_REASON.search(reason):
                result["gpu_skipped"] += 1
            else:
                result["other_skipped"].append(f"{name}: {reason}")
        else:
            result["passed"] += 1
    return result


def main(ctest_xml, pytest_xml):
    suites = [("C++ (ctest, CUDA sources compiled)", count(ctest_xml, ctest_skip_reason)),
              ("Python (pytest, installed package, CPU-only build)", count(pytest_xml, pytest_skip_reason))]
    ok = True
    print("CI summary:")
    for label, r in suites:
        other = len(r["other_skipped"])
        print(f"  {label}: {r['ran']} tests: {r['passed']} passed, {r['failed']} failed, {r['gpu_skipped']} skipped "
              f"for want of a GPU" + (f", {other} skipped for other reasons" if other else ""))
        for line in r["other_skipped"][:20]:
            print(f"    skipped, not for want of a GPU: {line}")
        ok = ok and r["ran"] > 0 and r["failed"] == 0 and other == 0
    passed = sum(r["passed"] for _, r in suites)
    failed = sum(r["failed"] for _, r in suites)
    skipped = sum(r["gpu_skipped"] + len(r["other_skipped"]) for _, r in suites)
    print(f"total: {passed} passed, {failed} failed, {skipped} skipped")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
