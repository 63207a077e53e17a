"""One plan format, fragments.plan/1, defined once in runtime/plan.schema.json (JSON Schema 2020-12):

- every plan written in the repository (README.md, docs/, examples/, bench/, cli/, fragkit/, tools/, python/,
  tests/python, tests/fixtures, the fuzz corpus; JSON code blocks and files, JSON inline in scripts, Python literals) is
  valid against the schema and parsed by the C++ parser (fragments._C.check_plan: runtime::Plan::parse,
  what `frag run` reads), so a plan added to the docs that either refuses fails here;
- the parser's step fields, actions and version are the schema's, and README's field table lists them;
- Python's Step.to_json (what every trace hands the C++ parser) writes what the schema allows;
- the schema and the parser refuse the same mutations of a plan, except for the checks the schema says it
  cannot express (index syntax, an index beside "segment"/"heads" ending in "...", "steps" ranges a < b,
  ascending "rows", consecutive "heads", one save per name);
- a plan naming another version is refused in words; a plan without one reads as /1.

    PYTHONPATH=python python tests/runtime/plan_schema_test.py [ROOT]

ROOT is the checkout (default: the current folder). Under Bazel the current folder is the runfiles root:
README.md there is a link into the checkout, and the test scans the checkout it leads to.
"""
import ast
import copy
import json
import os
import re
import sys
import tempfile
import types
import unittest

import jsonschema
import torch

import fragments  # noqa: F401  (loads fragments._C)
from fragments import _C
from fragments import Trace
from fragments.core.step import Step

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
del sys.argv[1:]
# Under Bazel, README.md in the runfiles links into the checkout: scan the checkout itself.
CHECKOUT = os.path.dirname(os.path.realpath(os.path.join(ROOT, "README.md")))
if not os.path.isfile(os.path.join(CHECKOUT, "runtime", "plan.schema.json")):
    CHECKOUT = ROOT
with open(os.path.join(ROOT, "runtime", "plan.schema.json")) as f:
    SCHEMA = json.load(f)
jsonschema.Draft202012Validator.check_schema(SCHEMA)

# Where plans are written; C++ tests are left out (they hold deliberately bad plans, as C++ initializers).
PLACES = ["README.md", "docs", "examples", "bench", "cli", "fragkit", "tools", "python", "tests/python",
          "tests/fixtures", "tests/fuzz"]
SKIPPED_DIRS = {"__pycache__", ".git", "node_modules"}
SUFFIXES = (".md", ".json", ".py", ".sh", ".ipynb")
# Where a JSON value that looks like a plan may start in text that is not all JSON.
STARTS = re.compile(r'\{\s*"interventions"\s*:|\[\s*\{\s*"at"\s*:|\{\s*"at"\s*:|\{\s*"key"\s*:')
# The checks the schema leaves to the parser (its description lists them): the parser's words for them.
PARSER_ONLY = ('"index": index ', "may address the last dim", "(step 0 is the prefill)",
               '"rows" must be in ascending order', "consecutive head numbers", "already saved")


def validator(definition):
    return jsonschema.Draft202012Validator({"$ref": f"#/$defs/{definition}", "$defs": SCHEMA["$defs"]})


PLAN = jsonschema.Draft202012Validator(SCHEMA)
STEP = validator("step")
VLLM_REQUEST = validator("vllm_request")


def is_step(value):
    return isinstance(value, dict) and "at" in value and "do" in value


def as_plan(value):
    """The plan `value` is (a list of steps, a plan object, one step), or None."""
    if isinstance(value, dict) and "interventions" in value:
        return value
    if isinstance(value, list) and value and all(is_step(v) for v in value):
        return value
    if is_step(value):
        return [value]
    return None


def is_vllm(plan):
    """A vLLM request plan (docs/vllm.md): "key"/"base" beside the steps, a step's engine "step", or a value
    "@name" (a steering vector the OpenAI server registered)."""
    steps = plan.get("interventions", []) if isinstance(plan, dict) else plan
    if not isinstance(steps, list):
        return False
    return bool(isinstance(plan, dict) and ({"key", "base"} & set(plan))) or any(
        isinstance(s, dict) and ("step" in s or str(s.get("value", "")).startswith("@")) for s in steps)


def registered_vectors(plan):
    """A vLLM request plan with its "@name" values (steering vectors the server registered at start) as the
    front end resolves them before any check (python/fragments/vllm/_plan.py: a file and tensor of that name)."""
    def resolve(step):
        if isinstance(step, dict) and isinstance(step.get("value"), str) and step["value"].startswith("@"):
            return {**step, "value": f"registered-vectors.safetensors:{step['value'][1:]}"}
        return step
    if isinstance(plan, dict):
        return {**plan, "interventions": [resolve(s) for s in plan.get("interventions", [])]}
    return [resolve(s) for s in plan]


def core_plan(plan):
    """A vLLM request plan as its front end hands it to the C++ parser (python/fragments/vllm/_plan.py)."""
    plan = registered_vectors(plan)
    steps = plan.get("interventions", []) if isinstance(plan, dict) else plan
    out = {"interventions": [{k: v for k, v in s.items() if k != "step"} for s in steps]}
    if isinstance(plan, dict) and "format" in plan:
        out["format"] = plan["format"]
    return out


def schema_errors(plan):
    """[] if `plan` is valid, else the most telling error (jsonschema's best_match), with where it is."""
    if is_vllm(plan):
        plan = registered_vectors(plan)
        errors = list(VLLM_REQUEST.iter_errors(plan if isinstance(plan, dict) else {"interventions": plan}))
    else:
        errors = list(PLAN.iter_errors(plan))
    if not errors:
        return []
    best = jsonschema.exceptions.best_match(errors)
    return [f"at /{'/'.join(map(str, best.absolute_path))}: {best.message}"]


def cpp_error(plan, source="plan.json"):
    """The C++ parser's refusal of `plan`, or None."""
    try:
        _C.check_plan(json.dumps(core_plan(plan) if is_vllm(plan) else plan), source)
        return None
    except _C.FragError as e:
        return str(e)


# ---- finding the plans

def json_values(text):
    """(offset, value) for every JSON value at a STARTS match not inside an earlier one."""
    decoder, end = json.JSONDecoder(), 0
    for match in STARTS.finditer(text):
        if match.start() < end:
            continue
        try:
            value, stop = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue  # not JSON (a Python expression, prose with "..."): the Python pass or nothing reads it
        end = stop
        yield match.start(), value


def python_values(source):
    """(line, value) for every literal plan in Python source (outermost first; non-literals skipped)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    taken = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Dict, ast.List)) or any(
                a.lineno <= node.lineno and node.end_lineno <= b for a, b in taken):
            continue
        try:
            value = ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if as_plan(value) is not None:
            taken.append((node, node.end_lineno))
            yield node.lineno, value


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


def markdown_plans(path, text):
    """Plans in a Markdown file: every ```json block must be JSON; other blocks and prose are scanned."""
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        language, body, line = block.group(1), block.group(2), line_of(text, block.start(2))
        if language == "json" and STARTS.search(body):
            try:
                value = json.loads(body)
            except json.JSONDecodeError as e:
                raise AssertionError(f"{path}:{line + e.lineno - 1}: a ```json block with a plan is not JSON: {e}")
            yield line, value
        elif language == "python":
            found = list(python_values(body))
            yield from ((line + n - 1, v) for n, v in found)
            if not found:
                yield from ((line + line_of(body, o) - 1, v) for o, v in json_values(body))
        else:
            yield from ((line + line_of(body, o) - 1, v) for o, v in json_values(body))
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    yield from ((line_of(prose, o), v) for o, v in json_values(prose))


def file_plans(path, text):
    if path.endswith(".json"):
        yield 1, json.loads(text)
    elif path.endswith(".md"):
        yield from markdown_plans(path, text)
    elif path.endswith(".ipynb"):
        for cell in json.loads(text).get("cells", []):
            yield from python_values("".join(cell.get("source", [])))
    elif path.endswith(".py"):
        found = list(python_values(text))
        yield from found
        if not found:
            yield from ((line_of(text, o), v) for o, v in json_values(text))
    else:
        yield from ((line_of(text, o), v) for o, v in json_values(text))


def files():
    for place in PLACES:
        top = os.path.join(CHECKOUT, place)
        if os.path.isfile(top):
            yield top
        for folder, dirs, names in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("bazel-"))
            for name in sorted(names):
                if name.endswith(SUFFIXES):
                    yield os.path.join(folder, name)


def repository_plans():
    """[(where, plan)] for every plan written in the repository."""
    plans = []
    for path in files():
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if '"at"' not in text and "interventions" not in text:
            continue
        relative = os.path.relpath(path, CHECKOUT)
        for line, value in file_plans(relative, text):
            plan = as_plan(value)
            if plan is not None:
                plans.append((f"{relative}:{line}", plan))
    return plans


README_PLAN = None  # the README's plan, the base of the mutation test


class RepositoryPlans(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.plans = repository_plans()

    def test_every_plan_in_the_repository_is_valid_and_parses(self):
        where = sorted({w.split(":")[0] for w, _ in self.plans})
        print(f"\n{len(self.plans)} plans in {len(where)} files: {', '.join(where)}", file=sys.stderr)
        for place in ("README.md", "docs/vllm.md", "tests/fuzz/corpus/plan/save.json", "tools/demo.sh"):
            self.assertIn(place, where, f"no plan found in {place}: the scan lost it")
        failures = []
        for source, plan in self.plans:
            for message in schema_errors(plan)[:3]:
                failures.append(f"{source}: against runtime/plan.schema.json: {message}")
            error = cpp_error(plan, source)
            if error:
                failures.append(f"{source}: the C++ parser refuses it: {error}")
        self.assertEqual(failures, [], "\n" + "\n".join(failures))

    def test_a_bad_plan_in_the_docs_would_fail(self):
        # The scan itself on a planted Markdown file: a misspelt action in a ```json block, a missing "as".
        text = ('# doc\n\n```json\n{"interventions": [{"at": "model.norm.output", "do": "sav", "as": "x"}]}\n```\n'
                'Inline: `[{"at": "model.norm.output", "do": "save"}]`.\n')
        found = [(line, as_plan(v)) for line, v in markdown_plans("planted.md", text)]
        self.assertEqual([line for line, _ in found], [4, 6])
        for _, plan in found:
            self.assertTrue(schema_errors(plan))
            self.assertIsNotNone(cpp_error(plan))
        with self.assertRaisesRegex(AssertionError, r"planted.md:\d+: a ```json block with a plan is not JSON"):
            list(markdown_plans("planted.md", '```json\n{"interventions": [\n```\n'))


class OneDefinition(unittest.TestCase):
    def test_the_parser_reads_the_schemas_fields_actions_and_version(self):
        step = SCHEMA["$defs"]["step_fields"]["properties"]
        self.assertEqual(_C.plan_step_fields(), list(step), "fields (and their order) differ")
        self.assertEqual(_C.plan_actions(), step["do"]["enum"])
        self.assertEqual(_C.PLAN_FORMAT, SCHEMA["$defs"]["format"]["const"])
        self.assertEqual(_C.PLAN_FORMAT, SCHEMA["title"])

    def test_the_readme_table_lists_the_fields_in_order(self):
        with open(os.path.join(ROOT, "README.md")) as f:
            readme = f.read()
        table = readme[readme.index("| field | meaning |"):]
        table = table[:table.index("\n\n")]
        self.assertEqual(re.findall(r"^\| `(\w+)` \|", table, re.M), _C.plan_step_fields())

    def test_python_steps_write_what_the_schema_allows(self):
        steps = [Step(at="model.layers.0.output", do="save", as_="save0", visit=1),
                 Step(at="model.layers.0.output", do="call", as_="save1", modules=["model.norm", "lm_head"]),
                 Step(at="model.layers.0.mlp.output", do="add", index="...,0:8", steps="decode", rows=[0, 2]),
                 Step(at="model.layers.0.mlp.output", do="set", steps=3),
                 Step(at="model.layers.0.mlp.output", do="scale", by=0.5, index=":,-1", steps="1:4"),
                 Step(at="model.layers.0.mlp.output", do="zero", index="...,5")]
        entries = [s.to_json("values.safetensors:v" if s.do in ("set", "add") else None) for s in steps]
        for entry in entries:
            self.assertEqual([e.message for e in STEP.iter_errors(entry)], [], entry)
        # The file Trace.plan_json writes for `frag run --plan` (a trace's steps; its values beside it).
        steps[2].value, steps[3].value = torch.ones(8), torch.zeros(())
        with tempfile.TemporaryDirectory() as folder:
            path = Trace.plan_json(types.SimpleNamespace(_steps=steps), folder)
            with open(path) as f:
                plan = json.load(f)
        self.assertEqual(plan["format"], _C.PLAN_FORMAT)
        self.assertEqual(schema_errors(plan), [])
        self.assertEqual(_C.check_plan(json.dumps(plan), path), len(steps))


def base_plan():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    plan = next(as_plan(v) for _, v in markdown_plans("README.md", readme) if isinstance(v, dict))
    plan = copy.deepcopy(plan)
    plan["interventions"].append({"at": "model.layers.2.output", "do": "zero", "steps": "decode", "rows": [0, 2]})
    return plan


VALUES = [None, True, 0, -1, 1.5, "", "x", "a:b", "3:1", "decode", "v.safetensors:v", [], [1], [2, 3], [-1],
          ["m"], [""], [1.5], {}]


class SchemaAndParserAgree(unittest.TestCase):
    def check(self, plan, what, disagreements):
        schema_ok, error = not schema_errors(plan), cpp_error(plan)
        if schema_ok and error and not any(word in error for word in PARSER_ONLY):
            disagreements.append(f"{what}: the schema accepts it, the parser refuses: {error}")
        if not schema_ok and not error:
            disagreements.append(f"{what}: the parser accepts it, the schema refuses: {schema_errors(plan)[0]}")
        return schema_ok, error

    def test_every_mutation_of_the_readme_plan(self):
        plan, disagreements, refused = base_plan(), [], 0
        self.assertEqual(self.check(plan, "the README plan", disagreements), (True, None))
        fields = _C.plan_step_fields() + ["colour"]
        for i, step in enumerate(plan["interventions"]):
            for field in fields:
                mutations = [(f"step {i} without {field}", {k: v for k, v in step.items() if k != field})]
                mutations += [(f"step {i} {field}={json.dumps(v)}", {**step, field: v}) for v in VALUES]
                for what, mutated in mutations:
                    other = copy.deepcopy(plan)
                    other["interventions"][i] = mutated
                    refused += self.check(other, what, disagreements)[1] is not None
        self.assertEqual(disagreements, [], "\n" + "\n".join(disagreements))
        self.assertGreater(refused, 500, "the mutations should mostly be refused")

    def test_versions(self):
        steps = base_plan()["interventions"]
        for plan in (steps, {"interventions": steps}, {"format": "fragments.plan/1", "interventions": steps}):
            self.assertEqual(schema_errors(plan), [])
            self.assertIsNone(cpp_error(plan))
        error = cpp_error({"format": "fragments.plan/2", "interventions": steps}, "steer.json")
        self.assertEqual(error, 'steer.json: plan format is "fragments.plan/2", expected "fragments.plan/1" (this '
                                "build reads that version only)")
        for plan in ({"format": 1, "interventions": steps}, {"format": "fragments.table/1", "interventions": steps},
                     {"fromat": "fragments.plan/1", "interventions": steps}, "plan", 3):
            self.assertTrue(schema_errors(plan), plan)
            self.assertIsNotNone(cpp_error(plan), plan)
        self.assertIn('unknown plan field "fromat" (did you mean "format"?)',
                      cpp_error({"fromat": "fragments.plan/1", "interventions": steps}))


if __name__ == "__main__":
    unittest.main(verbosity=2)
