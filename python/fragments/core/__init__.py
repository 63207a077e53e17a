"""What every layer of the Python front end shares (the bottom layer: it imports only fragments._C and torch).

    errors    FragmentsError, StepError, the user's file:line, did-you-mean
    step      Step (runtime::PlanStep field for field), PythonStep, index text
    graph     the expression graph a trace records (nodes, evaluation, meta shapes)
    saved     SavedValue: what `.save()` returns
    regions   head regions and heads, an invoke's rows and tokens: the index arithmetic, once
    tokens    token ids as batches (ragged batches right-padded)
    executor  the one executor of Python-side steps (edits by expressions, `.apply`, captures)

docs/design.md ("From Python") shows where each sits.
"""
