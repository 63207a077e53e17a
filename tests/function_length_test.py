"""No library function over 80 lines in ir/, passes/, runtime/, program/, python/, and no Python source file
over 500 lines in python/ (the project's style rules; issue 41 split the package's 1,043-line module).

Functions are found by lizard (tools/requirements.txt), which parses C++ and Python; a function's length is
its lines from signature to closing brace (C++) or last statement (Python), comments and blank lines
included, as a reader scrolls them. The check must catch a planted 81-line function (C++ and Python) and
pass a planted 80-line one: both go through `long_functions`, the function that checks the tree; likewise a
planted 501-line Python file and a 500-line one through `long_files`.

  python tests/function_length_test.py [ROOT]   # ROOT: the checkout (default: this file's ../)
Prints one line per offender and GoogleTest's summary lines (tools/summarize_tests.py counts them).
"""
import os
import sys
import tempfile

LIMIT = 80
FILE_LIMIT, FILE_FOLDERS = 500, ("python",)  # lines of a Python source file (blank lines and comments count)
FOLDERS = ("ir", "passes", "runtime", "program", "python")
SUFFIXES = (".h", ".cpp", ".cc", ".py")


def long_functions(root, folders=FOLDERS, limit=LIMIT):
    """[(path relative to root, line, name, length)] of the functions in `folders` longer than `limit` lines."""
    import lizard  # pylint: disable=import-outside-toplevel

    found = []
    for folder in folders:
        for directory, subdirs, files in os.walk(os.path.join(root, folder)):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith((".", "__pycache__")))
            for name in sorted(files):
                if not name.endswith(SUFFIXES):
                    continue
                path = os.path.join(directory, name)
                for fn in lizard.analyze_file(path).function_list:
                    length = fn.end_line - fn.start_line + 1
                    if length > limit:
                        found.append((os.path.relpath(path, root), fn.start_line, fn.name, length))
    return found


def long_files(root, folders=FILE_FOLDERS, limit=FILE_LIMIT):
    """[(path relative to root, lines)] of the Python files in `folders` longer than `limit` lines."""
    found = []
    for folder in folders:
        for directory, subdirs, files in os.walk(os.path.join(root, folder)):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith((".", "__pycache__")))
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as f:
                    lines = sum(1 for _ in f)
                if lines > limit:
                    found.append((os.path.relpath(path, root), lines))
    return found


def planted_cpp(lines):
    """A C++ function of exactly `lines` lines (signature to closing brace)."""
    body = [f"  x += {i};" for i in range(lines - 3)]
    return "\n".join(["namespace frag {", "int planted(int x) {", *body, "  return x;", "}", "}  // namespace frag", ""])


def planted_py(lines):
    """A Python function of exactly `lines` lines (def to last statement)."""
    body = [f"    x += {i}" for i in range(lines - 2)]
    return "\n".join(["def planted(x):", *body, "    return x", ""])


def self_check():
    """Failures of the check on planted files: an 81-line function must be reported, an 80-line one not."""
    failures = []
    with tempfile.TemporaryDirectory() as probe:
        for folder, name, make in (("runtime", "planted.cpp", planted_cpp), ("python", "planted.py", planted_py)):
            os.makedirs(os.path.join(probe, folder), exist_ok=True)
            path = os.path.join(probe, folder, name)
            for lines, reported in ((LIMIT + 1, True), (LIMIT, False)):
                with open(path, "w") as f:
                    f.write(make(lines))
                found = long_functions(probe, folders=(folder,))
                seen = [length for _, _, fn, length in found if "planted" in fn]
                if reported and seen != [lines]:
                    failures.append(f"a planted {lines}-line function in {folder}/{name} is not reported (saw {found})")
                elif not reported and found:
                    failures.append(f"a planted {lines}-line function in {folder}/{name} is reported: {found}")
                else:
                    print(f"ok: a planted {lines}-line function in {folder}/{name} is "
                          f"{'reported' if reported else 'accepted'}")
            os.remove(path)
        path = os.path.join(probe, "python", "planted.py")
        for lines, reported in ((FILE_LIMIT + 1, True), (FILE_LIMIT, False)):
            with open(path, "w") as f:
                f.write("x = 0\n" * lines)
            seen = long_files(probe)
            if seen != ([("python/planted.py", lines)] if reported else []):
                failures.append(f"a planted {lines}-line python/planted.py: the file check saw {seen}")
            else:
                print(f"ok: a planted {lines}-line python/planted.py is {'reported' if reported else 'accepted'}")
    return failures


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    try:
        import lizard  # noqa: F401 pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        print("FAIL: lizard is not installed in this Python (pip install -r tools/requirements.txt)")
        return 1
    failures = self_check()
    offenders = long_functions(root)
    for path, line, name, length in offenders:
        print(f"FAIL: {path}:{line}: {name} is {length} lines (at most {LIMIT})")
    if not offenders:
        print(f"ok: no function over {LIMIT} lines in {', '.join(f + '/' for f in FOLDERS)}")
    big = long_files(root)
    for path, lines in big:
        print(f"FAIL: {path} is {lines} lines (at most {FILE_LIMIT})")
    if not big:
        print(f"ok: no Python file over {FILE_LIMIT} lines in {', '.join(f + '/' for f in FILE_FOLDERS)}")
    checks = 8  # six planted files, the two checks of the tree
    failed = len(failures) + (1 if offenders else 0) + (1 if big else 0)
    for failure in failures:
        print("FAIL: " + failure)
    print(f"[  PASSED  ] {checks - failed} tests.")
    if failed:
        print(f"[  FAILED  ] {failed} tests, listed above")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
