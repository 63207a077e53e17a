#!/usr/bin/env python3
"""Keeps docs/passes.md honest.

    python3 tests/passes/passes_catalogue_test.py --generator PASSES_CATALOGUE --pt RANK0.pt --pt2 RANK0.pt2

(Bazel: bazel test //tests/passes:passes_catalogue_test.) Checks that
  - every header in passes/ has a section in docs/passes.md (opening with **`passes/<name>.h`**, or a heading
    naming it);
  - every IR excerpt (a code block after `<!-- ir: SECTION -->`) is what the passes print today: its lines,
    `...` lines skipped, appear in that order in SECTION of passes_catalogue's output, run here on the tiny
    kit model;
  - every frag:: op the page names has a schema in ir/op_schemas.h;
  - every frag::passes function the page names is declared in a passes/ header.
Run from the repository root (Bazel: the runfiles root)."""
import argparse
import glob
import os
import re
import subprocess
import sys
import unittest

DOC = "docs/passes.md"
ARGS = None


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def sections(output):
    """{name: [lines]} of the generator's output ("=== name ===" opens a section)."""
    out, current = {}, None
    for line in output.splitlines():
        m = re.fullmatch(r"=== (.+) ===", line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    return out


def excerpts(doc):
    """[(section, [lines], line number)] of every `<!-- ir: SECTION -->` code block."""
    found = []
    for m in re.finditer(r"<!-- ir: (.+?) -->\n```[a-z0-9]*\n(.*?)```", doc, re.S):
        found.append((m.group(1), m.group(2).splitlines(), doc[:m.start()].count("\n") + 1))
    return found


class PassesCatalogueTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.doc = read(DOC)
        run = subprocess.run([ARGS.generator, ARGS.pt, ARGS.pt2], capture_output=True, text=True)
        if run.returncode != 0:
            raise AssertionError("passes_catalogue failed (%d): %s" % (run.returncode, run.stderr))
        cls.output = sections(run.stdout)

    def test_every_pass_header_has_a_section(self):
        headers = sorted(os.path.basename(h) for h in glob.glob("passes/*.h"))
        self.assertGreater(len(headers), 5, "passes/ headers not found from %s" % os.getcwd())
        # A section opens with its headers in bold (**`passes/x.h`**), or names one in its heading.
        headings = "\n".join(line for line in self.doc.splitlines() if line.startswith("#"))
        missing = [h for h in headers
                   if "**`passes/%s`**" % h not in self.doc and "`passes/%s`" % h not in headings]
        self.assertEqual(missing, [], "%s: no section opens with these headers" % DOC)

    def test_every_excerpt_is_printed_by_the_passes(self):
        found = excerpts(self.doc)
        self.assertGreater(len(found), 10, "%s: expected IR excerpts after <!-- ir: SECTION --> lines" % DOC)
        for name, lines, line_number in found:
            with self.subTest(section=name, line=line_number):
                self.assertIn(name, self.output, "%s:%d: passes_catalogue prints no section %r"
                              % (DOC, line_number, name))
                printed, at = self.output[name], 0
                for line in lines:
                    if line.strip() == "...":
                        continue
                    found = next((i for i in range(at, len(printed)) if printed[i] == line), None)
                    if found is None:
                        self.fail("%s:%d: section %r: this line is not printed (after line %d of the section), "
                                  "or not in this order: %r" % (DOC, line_number, name, at, line))
                    at = found + 1

    def test_every_frag_op_has_a_schema(self):
        schemas = read("ir/op_schemas.h")
        known = set(re.findall(r'"(frag::\w+(?:\.\w+)?)\(', schemas))
        self.assertIn("frag::gather", known)
        named = set(re.findall(r"\bfrag::(?!passes\b|ir\b|Error\b)(\w+(?:\.at)?)", self.doc))
        # The .pt2 spelling: torch.ops.frag.<op>.default / .at
        named |= {op + (".at" if overload == "at" else "")
                  for op, overload in re.findall(r"\bfrag\.(\w+)\.(default|at)\b", self.doc)}
        self.assertGreater(len(named), 4)
        unknown = sorted(op for op in named if "frag::" + op not in known)
        self.assertEqual(unknown, [], "%s names frag:: ops that ir/op_schemas.h has no schema for" % DOC)

    def test_every_named_entry_point_is_declared(self):
        headers = "\n".join(read(h) for h in glob.glob("passes/*.h"))
        named = set(re.findall(r"\bpasses::(\w+)", self.doc))
        self.assertGreater(len(named), 8)
        undeclared = sorted(n for n in named if not re.search(r"\b%s\b" % n, headers))
        self.assertEqual(undeclared, [], "%s names functions no passes/ header declares" % DOC)


def main():
    global ARGS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--generator", required=True, help="the passes_catalogue binary")
    p.add_argument("--pt", required=True, help="rank0.pt of catalogue_model.py's export")
    p.add_argument("--pt2", required=True, help="rank0.pt2 of catalogue_model.py's export")
    ARGS, rest = p.parse_known_args()
    ARGS.generator, ARGS.pt, ARGS.pt2 = (os.path.abspath(x) for x in (ARGS.generator, ARGS.pt, ARGS.pt2))
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
