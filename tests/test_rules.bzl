"""The shapes of test this tree writes again and again, each written once.

gtest: a GoogleTest binary of one source file, `name`.cpp.
python_script_test: Python test files run by a package's runner script with the project's Python.
test_library: a test-only C++ library of `name`.cpp and `name`.h.
sources_for_tests: a package's sources as files, which the tree-wide checks read.
"""

load("@rules_cc//cc:defs.bzl", "cc_library", "cc_test")

def gtest(name, deps, gmock = False, **kwargs):
    """cc_test `name` from `name`.cpp, linked with GoogleTest's main.

    gmock: also gMock's matchers (libgmock of libgtest-dev; Debian's package has no @system target for it).
    Other arguments (size, data, local_defines, ...) are cc_test's."""
    if gmock:
        kwargs["linkopts"] = ["-lgmock"]
    cc_test(
        name = name,
        srcs = [name + ".cpp"],
        deps = deps + ["@system//:gtest_main"],
        **kwargs
    )

def test_library(name, deps):
    """cc_library `name` of `name`.cpp and `name`.h, for tests only."""
    cc_library(
        name = name,
        testonly = True,
        srcs = [name + ".cpp"],
        hdrs = [name + ".h"],
        deps = deps,
    )

def python_script_test(name, runner, scripts = [], data = [], **kwargs):
    """sh_test `name`: `runner` (a shell script of the calling package) gets the project's Python
    (@torch//:python) and then `scripts` (the test files it runs, paths in the calling package).

    The scripts and the Python are data already; `data` is the rest. Other arguments (size, env, tags, ...)
    are sh_test's."""
    native.sh_test(
        name = name,
        srcs = [runner],
        args = ["$(location @torch//:python)"] + scripts,
        data = scripts + data + ["@torch//:python"],
        **kwargs
    )

def sources_for_tests(patterns = ["*.h", "*.cpp"], visibility = ["//tests:__subpackages__"]):
    """filegroup `sources`: the package's files matching `patterns`, read as text by the tree-wide checks
    (tests:layering_test, tests:function_length_test, tests/runtime:plan_schema_test)."""
    native.filegroup(
        name = "sources",
        srcs = native.glob(patterns),
        visibility = visibility,
    )
