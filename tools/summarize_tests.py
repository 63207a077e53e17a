#!/usr/bin/env python3
"""Counts test cases in Bazel's test logs and prints one line: "N passed, N failed, N skipped".

GoogleTest logs end with "[  PASSED  ] N tests." / "[  FAILED  ] N tests," / "[  SKIPPED ] N tests,";
unittest logs with "Ran N tests" and "FAILED (failures=F, errors=E, skipped=S)" or "OK (skipped=S)", each
such run counted (a runner may run several files in one target).
A target whose log has neither (it did not build, crashed or timed out) counts as one failure. Given the
labels of the build's tests, only their logs count: a target renamed or removed leaves its last log behind
(stop 46 counted a renamed target's 7 old cases), and those are named as not counted.
Shell tests print GoogleTest's summary lines themselves. `--log FILE` adds a log written outside Bazel
(tools/fuzz.sh's), counted the same way. Before that line it lists the 10 slowest Bazel tests (`--slowest N`,
0: none) by their test.xml times, so a slow CI run shows where its time went.
"""
import pathlib
import re
import sys
import xml.etree.ElementTree as ET


def count(log: str):
    passed = failed = skipped = 0
    found = False
    for m in re.finditer(r"^\[  PASSED  \] (\d+) tests?", log, re.M):
        passed += int(m.group(1)); found = True
    for m in re.finditer(r"^\[  FAILED  \] (\d+) tests?,", log, re.M):
        failed += int(m.group(1)); found = True
    for m in re.finditer(r"^\[  SKIPPED \] (\d+) tests?,", log, re.M):
        skipped += int(m.group(1)); found = True
    # every unittest run in the log (a runner may run several files): "Ran N tests in Xs", a blank line, its result
    for m in _UNITTEST_RUN.finditer(log):
        found = True
        # "failures=1, errors=2, skipped=3, expected failures=4, unexpected successes=5"
        details = {k.strip(): int(v) for k, v in (item.split("=") for item in (m.group(3) or "").split(", ") if item)}
        bad = details.get("failures", 0) + details.get("errors", 0) + details.get("unexpected successes", 0)
        skip = details.get("skipped", 0)
        passed += int(m.group(1)) - bad - skip; failed += bad; skipped += skip  # (an expected failure passes)
        if m.group(2) == "FAILED" and not bad:  # (a FAILED run always names its count; never read it as a pass)
            failed += 1
    return found, passed, failed, skipped


_UNITTEST_RUN = re.compile(r"^Ran (\d+) tests? in [0-9.]+s\n\n(OK|FAILED)(?: \(([^)\n]*)\))?$", re.M)


def seconds(xml_path: pathlib.Path):
    """A test's run time from its test.xml: GoogleTest's total, else the time Bazel wrote for the target."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return None
    for node in [root] + list(root.iter("testsuite")) + list(root.iter("testcase")):
        if node.get("time"):
            try:
                return float(node.get("time"))
            except ValueError:
                return None
    return None


def main() -> int:
    args = sys.argv[1:]
    extra_logs = []
    slowest = 10
    if "--slowest" in args:
        i = args.index("--slowest")
        slowest = int(args[i + 1])
        del args[i:i + 2]
    while "--log" in args:
        i = args.index("--log")
        extra_logs.append(pathlib.Path(args[i + 1]))
        del args[i:i + 2]
    root = pathlib.Path(args[0])
    expected = set(args[1:])  # labels that must have a log; given, only their logs count
    totals = [0, 0, 0]
    seen, stale = set(), []
    for log_path in sorted(root.rglob("test.log")):
        label = str(log_path.parent.relative_to(root))
        if expected and label not in expected:  # a target renamed or removed since: its old log stays on disk
            stale.append(label)
            continue
        seen.add(label)
        found, p, f, s = count(log_path.read_text(errors="replace"))
        if not found:
            print("summarize: %s: no test results in its log; counted as 1 failure" % label)
            f = 1
        totals[0] += p; totals[1] += f; totals[2] += s
    for log_path in extra_logs:
        found, p, f, s = count(log_path.read_text(errors="replace")) if log_path.exists() else (False, 0, 0, 0)
        if not found:
            print("summarize: %s: no test results in it; counted as 1 failure" % log_path)
            f = 1
        totals[0] += p; totals[1] += f; totals[2] += s
    times = []
    for label in seen:
        t = seconds(root / label / "test.xml")
        if t is not None:
            times.append((t, label))
    times.sort(reverse=True)
    if slowest and times:
        print("summarize: the %d slowest tests (s, test.xml; a cached result keeps its first run's time; "
              "%d tests, %.0f s in all):" % (min(slowest, len(times)), len(times), sum(t for t, _ in times)))
        for t, label in times[:slowest]:
            print("summarize:   %6.0f  %s" % (t, label))
    if stale:
        print("summarize: not counted, the logs of %d targets no longer in the build: %s" % (len(stale), ", ".join(stale)))
    for label in sorted(expected - seen):
        print("summarize: %s: no log (did not build or run); counted as 1 failure" % label)
        totals[1] += 1
    print("%d passed, %d failed, %d skipped" % tuple(totals))
    return 0 if totals[1] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
