"""Writes smollm2_session.ipynb (the notebook is the source users read; this keeps its cells reviewable):
    python tests/python/notebooks/make_notebook.py"""
import os

import nbformat
cells = []
md = lambda s: cells.append(nbformat.v4.new_markdown_cell(s))
code = lambda s: cells.append(nbformat.v4.new_code_cell(s.strip("\n")))
md("""# SmolLM2 at tp 3, loaded once

`fragments.LanguageModel` starts three rank processes once; every cell below runs its trace there and gets
the saved values back once. Each cell compares with nnsight on transformers (tp 1, the same GGUF weights).
`SMOLLM2_TP3` names the export folder (`python -m fragkit.checkpoint --from smollm2 --tp 3 --out DIR`).""")
code('''
import os, torch, warnings
import fragments

model = fragments.LanguageModel(os.environ["SMOLLM2_TP3"], tp=3)
print(model)
print("PIDS", model.pids)
''')
code('''
# The reference: transformers on the same GGUF, traced by nnsight (tp 1).
from fragkit.checkpoint import smollm2_gguf_path
from transformers import AutoModelForCausalLM
from nnsight import LanguageModel as NNsight

gguf = smollm2_gguf_path()
hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32).eval()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    lm = NNsight(hf, tokenizer=model.tokenizer)

def relative(a, b):
    a, b = (torch.as_tensor(getattr(x, "value", x)).double() for x in (a, b))  # a SavedValue's .value: its tensor
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

TOL = 1e-4  # float32, relative to the reference's largest magnitude (tools/real_model_check.py)
prompt = "The capital of France is"
ids = model.tokenizer(prompt, return_tensors="pt").input_ids
''')
code('''
# Save a layer (text in: the checkpoint's tokenizer). A decoder layer's .input is its hidden states.
with model.trace(prompt):
    h5 = model.model.layers[5].output.save()
    h5_in = model.model.layers[5].input.save()
    norm5 = (model.model.layers[5].output * 2).norm(dim=-1).save()

with torch.no_grad(), lm.trace(ids):
    ref5_in = lm.model.layers[5].input.save()  # nnsight: in the order the model runs
    ref5 = lm.model.layers[5].output.save()
print(h5.shape, relative(h5, ref5), relative(h5_in, ref5_in))
assert relative(h5, ref5) < TOL and relative(h5_in, ref5_in) < TOL
assert relative(norm5, (2 * ref5).norm(dim=-1)) < TOL
''')
code('''
# A logit lens keeping only the top 5 tokens of the last position at every layer.
with model.trace(prompt):
    lens = [model.lm_head(model.model.norm(layer.output))[:, -1].softmax(-1).topk(5).save()
            for layer in model.model.layers]

ref_lens = []
with torch.no_grad(), lm.trace(ids):
    for layer in lm.model.layers:
        ref_lens.append(lm.lm_head(lm.model.norm(layer.output))[:, -1].softmax(-1).topk(5).save())
worst = max(relative(ours.values, theirs.values) for ours, theirs in zip(lens, ref_lens))
same = sum(torch.equal(ours.indices, theirs.indices) for ours, theirs in zip(lens, ref_lens))
for i in (0, 10, 20, 29):
    print(i, model.tokenizer.convert_ids_to_tokens(lens[i].indices[0].tolist()))
print("worst", worst, "layers with the same top 5:", same)
assert worst < TOL and same == len(lens)
''')
code('''
# A head ablation: head 3 of layer 8 zeroed at o_proj's input (whole coordinates, 64 wide).
L, H, D = 8, 3, 64
with model.trace(prompt):
    model.model.layers[L].self_attn.o_proj.input.heads[H] = 0   # the same as [..., H * D:(H + 1) * D] = 0
    ablated = model.output.save()

with torch.no_grad(), lm.trace(ids):
    lm.model.layers[L].self_attn.o_proj.input[..., H * D:(H + 1) * D] = 0
    ref_ablated = lm.lm_head.output.save()
with torch.no_grad():
    clean_logits = hf(ids).logits
print(relative(ablated, ref_ablated), "moved by", relative(ref_ablated, clean_logits))
assert relative(ablated, ref_ablated) < TOL and relative(ref_ablated, clean_logits) > 10 * TOL
''')
code('''
# Patching across two prompts in one trace: layer 6's output at the differing position, clean into corrupted.
clean, corrupt = "The capital of France is", "The capital of Italy is"
pos = int((model.tokenizer(clean, return_tensors="pt").input_ids != model.tokenizer(corrupt, return_tensors="pt").input_ids).nonzero()[0, 1])
with model.trace() as tracer:
    with tracer.invoke(clean):
        source = model.model.layers[6].output[:, pos]
    with tracer.invoke(corrupt):
        model.model.layers[6].output[:, pos] = source
        patched = model.output.save()

clean_ids, corrupt_ids = (model.tokenizer(p, return_tensors="pt").input_ids for p in (clean, corrupt))
with torch.no_grad():
    with lm.trace(clean_ids):
        ref_source = lm.model.layers[6].output.save()
    with lm.trace(corrupt_ids):
        lm.model.layers[6].output[:, pos] = ref_source[:, pos]
        ref_patched = lm.lm_head.output.save()
print(patched.shape, relative(patched, ref_patched))
assert relative(patched, ref_patched) < TOL
''')
code('''
# Steering a generation: a vector added to layer 10's output at every step.
v = 4.0 * torch.randn(576, generator=torch.Generator().manual_seed(0))
with model.generate(prompt, max_new_tokens=12):
    model.model.layers[10].output[:] += v
    tokens = model.output.save()

with torch.no_grad(), lm.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=model.tokenizer.eos_token_id) as tracer:
    for step in tracer.iter[0:12]:  # nnsight: the edit at each of the 12 steps
        lm.model.layers[10].output[:] += v
    ref_tokens = tracer.result.save()
with torch.no_grad():
    plain = hf.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids),
                        pad_token_id=model.tokenizer.eos_token_id)
print(repr(model.tokenizer.decode(tokens[0, ids.shape[1]:])), "unsteered:", repr(model.tokenizer.decode(plain[0, ids.shape[1]:])))
assert tokens.tolist() == ref_tokens.tolist(), (tokens.tolist(), ref_tokens.tolist())
assert tokens.tolist() != plain.tolist()
''')
md("The kernel's end (or `model.close()`, or `with fragments.LanguageModel(...) as model:`) ends the ranks.")
nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
nbformat.write(nb, os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_session.ipynb"))
