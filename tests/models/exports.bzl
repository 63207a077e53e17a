"""Exports reference models with the Python kit at build time (genrules)."""

def export_model(name, model, tp, kv_heads = None, ep = False, layers = None, dtype = None, seed = None,
                 mlp = None, vocab_padding = None, format = None, tags = None, kv_cache = False):
    """Writes <name>/rank{r}.pt (format "export": rank{r}.pt2) for r < tp by running tools/export_model.py.
    tags = ["manual"]: built only when named (not by //...)."""
    flags = "--model %s --tp %d" % (model, tp)
    suffix = "pt"
    if format:
        flags += " --format %s" % format
        if format == "export":
            suffix = "pt2"
    if kv_cache:
        flags += " --kv-cache"
    if kv_heads:
        flags += " --kv-heads %d" % kv_heads
    if ep:
        flags += " --ep"
    if layers:
        flags += " --layers %d" % layers
    if seed != None:
        flags += " --seed %d" % seed
    if dtype:
        flags += " --dtype %s" % dtype
    if mlp:
        flags += " --mlp %s" % mlp
    if vocab_padding:
        flags += " --vocab-padding %d" % vocab_padding
    native.genrule(
        name = name,
        srcs = ["//fragkit"],
        outs = ["%s/rank%d.%s" % (name, r, suffix) for r in range(tp)],
        cmd = ("PYTHONDONTWRITEBYTECODE=1 $(location @torch//:python) $(location //tools:export_model.py) " +
               flags + " --out $(RULEDIR)/" + name + " > /dev/null"),
        tools = ["//tools:export_model.py", "@torch//:python"],
        visibility = ["//visibility:public"],
        tags = tags or [],
    )
