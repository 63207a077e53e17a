"""Exports reference models with the Python kit at build time (genrules)."""

def export_model(name, model, tp, kv_heads = None, ep = False, layers = None, dtype = None, seed = None,
                 mlp = None, vocab_padding = None):
    """Writes <name>/rank{r}.pt for r < tp by running tools/export_model.py."""
    flags = "--model %s --tp %d" % (model, tp)
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
        srcs = ["//tools:fragkit"],
        outs = ["%s/rank%d.pt" % (name, r) for r in range(tp)],
        cmd = ("PYTHONDONTWRITEBYTECODE=1 $(location @torch//:python) $(location //tools:export_model.py) " +
               flags + " --out $(RULEDIR)/" + name + " > /dev/null"),
        tools = ["//tools:export_model.py", "@torch//:python"],
        visibility = ["//visibility:public"],
    )
