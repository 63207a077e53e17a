"""The recorder every backend shares (above fragments.core, below the backends):

    proxy   Proxy: a value inside a trace; operators record; in-place operators make Pending edits
    tree    ModelTree: what the recorder knows of a model (modules, locations, head layouts), and its text
    envoy   the model as a trace sees it: modules (Envoy), locations (Location), heads (Region, Heads)
    tracer  Tracer: what one `with model.trace(...)` block records (Steps, PythonSteps, saves, expressions)
"""
