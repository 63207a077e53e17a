"""slow_tier: a test case that runs only with FRAG_SLOW=1 (the slow tier; README.md "Tests and benchmarks").

Cases moved out of the default tier for CI time, each one whose coverage the default tier keeps elsewhere
(`why` says where). In the default tier the case is skipped loudly: a line on standard error and the skip
reason both name FRAG_SLOW=1, and tools/summarize_tests.py counts it as skipped.
"""
import functools
import os
import sys

SLOW = os.environ.get("FRAG_SLOW") == "1"


def slow_tier(why):
    def wrap(test):
        @functools.wraps(test)
        def run(self, *args, **kwargs):
            if not SLOW:
                print("SKIPPED (slow tier, FRAG_SLOW=1 runs it): %s; %s" % (self.id(), why), file=sys.stderr)
                self.skipTest("FRAG_SLOW=1 runs it (slow tier); %s" % why)
            return test(self, *args, **kwargs)
        return run
    return wrap
