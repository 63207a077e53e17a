"""What each rank runs in tests/python/frontend/generation_test.py (importable: launch spawns its ranks)."""
import torch

import fragments

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
STEPS = 6


def _vector(width, seed, scale=8.0):
    return scale * torch.randn(width, generator=torch.Generator().manual_seed(seed))


def recomputed(model, prompt, steps):
    """Greedy tokens and each step's logits by the uncached forward (the whole sequence again each step)."""
    tokens, new, logits = torch.tensor([prompt]), [], []
    for _ in range(steps):
        with model.trace(tokens):
            out = model.output.save()
        logits.append(out.value[0, -1])
        nxt = out.value[:, -1].argmax(-1, keepdim=True)
        new.append(int(nxt))
        tokens = torch.cat([tokens, nxt], 1)
    return new, torch.stack(logits)


def scenarios(model):
    """Cached generation of a ragged batch, edits scoped to steps and rows, saves per step, sampling, stops."""
    m = model.model
    out = {}
    with model.generate(PROMPTS, max_new_tokens=STEPS) as gen:
        h = m.layers[0].output.save()
        tokens = model.output.save()
    out["batch"] = gen.new_tokens
    out["batch_logits"] = torch.stack(gen.logits)  # [steps, rows, vocab]
    out["save_shapes"] = [list(t.shape) for t in h.value]
    out["tokens_output"] = [t.tolist() for t in tokens.value]
    out["alone"] = []
    for p in PROMPTS:
        with model.generate([p], max_new_tokens=STEPS) as one:
            pass
        out["alone"].append(one.new_tokens[0])
    width = h.value[0].shape[-1]
    # An edit from step 3 on, and one on row 1 only.
    with model.generate(PROMPTS, max_new_tokens=STEPS) as gen:
        with gen.iter[3:]:
            m.layers[1].output[...] += _vector(width, 1)
    out["edited_from_3"] = gen.new_tokens
    with model.generate(PROMPTS, max_new_tokens=STEPS) as gen:
        with gen.rows([1]):
            m.layers[1].output[...] += _vector(width, 2)
    out["edited_row_1"] = gen.new_tokens
    with model.generate(PROMPTS, max_new_tokens=STEPS) as gen:
        with gen.prefill():
            pre = m.layers[1].output.save()
        with gen.decode():
            dec = m.layers[1].output.save()
    out["prefill_saves"] = len(pre.value) if isinstance(pre.value, list) else 1
    out["decode_saves"] = len(dec.value)
    # Sampling: the same seed gives the same tokens; top_p = tiny is greedy.
    runs = []
    for seed in (5, 5, 6):
        with model.generate(PROMPTS, max_new_tokens=STEPS, temperature=1.5, seed=seed) as gen:
            pass
        runs.append(gen.new_tokens)
    out["sampled"] = runs
    with model.generate(PROMPTS, max_new_tokens=STEPS, temperature=1.0, top_p=1e-6, seed=1) as gen:
        pass
    out["top_p_tiny"] = gen.new_tokens
    # EOS: row 0's third greedy token ends row 0 there.
    eos = out["batch"][0][2]
    with model.generate(PROMPTS, max_new_tokens=STEPS, eos_token_id=eos) as gen:
        pass
    out["eos"], out["eos_id"] = gen.new_tokens, eos
    streamed = list(model.stream(PROMPTS, max_new_tokens=STEPS))
    out["streamed"] = streamed
    return out


def rank_main(rank, path):
    model = fragments.load(path)
    return scenarios(model)


def tokens_and_logits(rank, path, prompts=None, steps=STEPS):
    """Greedy cached generation of a ragged batch: (new tokens per row, logits [steps, rows, vocab])."""
    model = fragments.load(path)
    with model.generate(prompts or PROMPTS, max_new_tokens=steps) as gen:
        pass
    return gen.new_tokens, torch.stack(gen.logits) if gen.logits is not None else None  # None: recomputed


def steered_tokens(rank, path, steps=STEPS):
    """Greedy tokens with a vector added at layer 1's output at every decode step (not the prefill)."""
    model = fragments.load(path)
    with model.generate(PROMPTS, max_new_tokens=steps) as gen:
        with gen.decode():
            model.model.layers[1].output[...] += _vector(64, 4)
    return gen.new_tokens


def lens(rank, path, steps=3):
    """A logit lens (model.norm then lm_head on layer 0's output, a plan `call` step) in a trace of one
    prompt and at every step of cached generation of PROMPTS: (trace lens, [per-step lens], new tokens)."""
    model = fragments.load(path)
    m = model.model
    with model.trace(torch.tensor([PROMPTS[2]])):
        traced = model.lm_head(m.norm(m.layers[0].output)).save()
    with model.generate(PROMPTS, max_new_tokens=steps) as gen:
        per_step = model.lm_head(m.norm(m.layers[0].output)).save()
    return traced.value, per_step.value, gen.new_tokens
