"""What each rank runs in tests/python/frontend/frontend_test.py (importable: launch spawns its ranks).

`scenarios` is the same code at tp=1 (in the test's process) and on each rank of a launched world; it
returns plain tensors and strings, which the test compares across ranks, with tp=1 and with `frag run`.
"""
import time
import warnings

import torch

import fragments

LAYER = 0  # the layer edited and read in the scenarios


def _vector(width, seed):
    return torch.randn(width, generator=torch.Generator().manual_seed(seed))


def scenarios(model, ids, other_ids):
    """Reads, edits, a logit lens, activation patching and a Python callable; returns name -> tensor."""
    m = model.model
    out = {}
    with model.trace(ids):
        qkv = m.layers[0].self_attn.qkv_proj.output.save()          # fused q|k|v segments
        down_in = m.layers[0].mlp.down_proj.input.save()            # a shard
        o_in = m.layers[1].self_attn.o_proj.input.save()
        resid = m.layers[1].output.save()                            # whole
        lens = model.lm_head(m.norm(m.layers[0].output)).save()     # logit lens, whole vocabulary
        logits = model.output.save()
    out.update(qkv=qkv.value, down_in=down_in.value, o_in=o_in.value, resid=resid.value, lens=lens.value,
               logits=logits.value)
    hidden = resid.value.shape[-1]
    with model.trace(ids):
        m.layers[0].output[:, -1] += _vector(hidden, 1)
        m.layers[0].mlp.gate_up_proj.output[..., 5] = 0
        m.layers[1].self_attn.o_proj.input[:, 1:3, :8] *= 0.5
        m.layers[1].mlp.down_proj.input[..., -4:] = 1.5
        edited_resid = m.layers[1].output.save()
        edited = model.output.save()
    out.update(edited=edited.value, edited_resid=edited_resid.value)
    # Activation patching: layer 0's output on `other_ids` replaces it on `ids` (same length).
    with model.trace(other_ids):
        source = m.layers[0].output.save()
    with model.trace(ids):
        m.layers[0].output = source
        patched = model.output.save()
    out.update(patch_source=source.value, patched=patched.value)
    # A Python callable, once per visit: moves the last position of layer 1's output (a scale would not
    # show: the final RMSNorm undoes it).
    before = model.python_calls

    def double_last(whole):
        whole = whole.clone()
        whole[:, -1] += _vector(whole.shape[-1], 3)
        return whole

    with model.trace(ids):
        m.layers[1].output.apply(double_last)
        applied = model.output.save()
    out["applied"] = applied.value
    out["python_calls"] = torch.tensor(model.python_calls - before)
    # A logit lens on a tensor outside a trace: an ad-hoc call chain, whole in, whole out.
    out["lens_outside"] = model.lm_head(m.norm(resid.value))
    out.update(heads(model, ids))
    out.update(repeats(model, ids, hidden))
    # Greedy generation with a steering edit at every step; saves are per-step lists. The edit covers every
    # position a forward computes: each position is then steered exactly once whether the file decodes from
    # a KV cache (TorchScript: one new position a step) or recomputes the prefix (.pt2), so both agree.
    with model.generate(ids[:, :4], max_new_tokens=3):
        m.layers[0].output[:] += 4 * _vector(hidden, 1)
        steps = m.layers[1].output.save()
        tokens = model.output.save()
    out["gen_tokens"] = tokens.value
    out["gen_steps"] = torch.tensor([len(steps.value)] + [s.shape[1] for s in steps.value])
    out["gen_last"] = steps.value[-1]
    return out


def repeats(model, ids, hidden):
    """The same trace again (a plan kept registered between forwards), another value, then plain traces:
    each forward computes its own trace's plan and nothing of an earlier one."""
    def edited(seed):  # a new tensor each time, equal for equal seeds
        o_in, _, logits = replay_trace(model, ids, _vector(hidden, seed))
        return o_in, logits

    out = {}
    out["rep_saved_a"], out["rep_a"] = edited(1)
    out["rep_saved_again"], out["rep_again"] = edited(1)
    _, out["rep_b"] = edited(2)
    _, out["rep_a_after_b"] = edited(1)
    with model.trace(ids):
        plain = model.output.save()
    out["rep_plain"] = plain.value
    return out


def heads(model, ids):
    """Head views of layer 0's attention: reads (checked by the test against the reshaped whole) and edits."""
    attn = model.model.layers[0].self_attn
    qkv = attn.qkv_proj.output
    with model.trace(ids):
        whole = qkv.save()
        k = qkv.k.save()
        k1 = qkv.k.heads[1].save()
        q_last = qkv.q.heads[-1].save()
        v0 = qkv.v.heads[0].save()
        o = attn.o_proj.input.save()
        o3 = attn.o_proj.input.heads[3].save()
    with model.trace(ids):
        qkv.k.heads[1] = 0
        qkv.q.heads[0] *= 0.5
        attn.o_proj.input.heads[2] += 1.0
        edited_qkv = qkv.save()
        edited = model.output.save()
    layout = model._head_layout(qkv.name)
    return {"h_whole": whole.value, "h_k": k.value, "h_k1": k1.value, "h_q_last": q_last.value, "h_v0": v0.value,
            "h_o": o.value, "h_o3": o3.value, "h_edited_qkv": edited_qkv.value, "h_edited": edited.value,
            "h_layout": torch.tensor([layout[s][i] for s in "qkv" for i in range(3)])}


def errors(model, ids):
    """Misuse, each caught: name -> message. Every rank must raise alike (the model stays usable)."""
    m = model.model
    found = {}

    def catch(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            # Ranks name their own files: compare the messages without that.
            found[name] = f"{type(e).__name__}: {e}".replace(f"rank{model.rank}.pt", "rank{rank}.pt")
        else:
            found[name] = "no error"

    catch("unknown_attribute", lambda: m.layers[0].mlpp)
    catch("unknown_layer", lambda: m.layers[7])

    def wrong_shape():
        with model.trace(ids):
            m.layers[0].output[:, -1] += torch.ones(7)
    catch("wrong_shape", wrong_shape)

    def wrong_full_shape():
        with model.trace(ids):
            m.layers[0].output = torch.zeros(1, 3, 5)
    catch("wrong_full_shape", wrong_full_shape)

    def early_read():
        with model.trace(ids):
            h = m.layers[0].output.save()
            h.shape  # noqa: B018 - read before the block ends
    catch("early_read", early_read)

    def own_trace_value():
        with model.trace(ids):
            h = m.layers[0].output.save()
            m.layers[1].output = h
    catch("own_trace_value", own_trace_value)

    def rank_local():
        with model.trace(ids):
            m.layers[0].mlp.act_fn.output[..., 0] = 0
    catch("rank_local", rank_local)

    catch("outside_trace", lambda: m.layers[0].output.save())

    def raising():
        def fn(whole):
            if model.rank == model.world_size - 1:
                raise ValueError("callable failed on purpose")
            return None
        with model.trace(ids):
            m.layers[1].output.apply(fn)
    catch("callable_raises", raising)

    def differing():
        with model.trace(ids):
            m.layers[1].output.apply(lambda whole: whole + model.rank)
    catch("callable_differs", differing)

    with model.trace(ids):
        after = model.output.save()
    return found, after.value


def rank_main(rank, path, ids, other_ids, hidden):
    """One rank of a launched world: the scenarios, the errors, and JSON_PLAN as a Python trace."""
    model = fragments.load(path)
    assert model.rank == rank
    results = scenarios(model, ids, other_ids)
    found, after = errors(model, ids)
    results["after_errors"] = after
    results["plan_trace"] = plan_trace(model, ids, hidden)
    return results, found


def fail_on_rank(rank, failing_rank, path):
    """For launch's failure test: one rank raises before loading; the others wait in the rendezvous."""
    if rank == failing_rank:
        raise KeyError("planted failure")
    fragments.load(path)
    return rank


# The JSON plan that plan_trace writes in Python; the test runs it through `frag run` (values.safetensors
# holds "v", the vector _vector(hidden, 1)).
JSON_PLAN = {"interventions": [
    {"at": "model.layers.0.self_attn.qkv_proj.output", "do": "save", "as": "qkv"},
    {"at": "model.layers.0.output", "do": "add", "value": "values.safetensors:v", "index": ":,-1"},
    {"at": "model.layers.0.mlp.gate_up_proj.output", "do": "zero", "index": "...,5"},
    {"at": "model.layers.1.self_attn.o_proj.input", "do": "scale", "by": 0.5, "index": ":,1:3,:8"},
    {"at": "model.layers.1.output", "do": "save", "as": "resid"},
    {"at": "model.layers.0.output", "do": "call", "modules": ["model.norm", "lm_head"], "as": "lens"},
]}


def plan_trace(model, ids, hidden):
    """JSON_PLAN, written with the Python API."""
    m = model.model
    with model.trace(ids):
        qkv = m.layers[0].self_attn.qkv_proj.output.save()
        m.layers[0].output[:, -1] += _vector(hidden, 1)
        m.layers[0].mlp.gate_up_proj.output[..., 5] = 0
        m.layers[1].self_attn.o_proj.input[:, 1:3, :8] *= 0.5
        resid = m.layers[1].output.save()
        lens = model.lm_head(m.norm(m.layers[0].output)).save()
        logits = model.output.save()
    return {"qkv": qkv.value, "resid": resid.value, "lens": lens.value, "logits": logits.value}


def run_exported_pair(rank, original, rewritten, ids):
    """Logits of this rank's original and rewritten torch.export archives (pt2_run_test.py), nothing
    registered; the model's collectives run on fragments' rank context."""
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # torch.export.load's
    fragments.rank_context()
    out = []
    for pattern in (original, rewritten):
        program = torch.export.load(pattern.format(rank=rank))
        with torch.no_grad():
            out.append(program.module()(ids))
    return tuple(out)


def every_location(model, ids):
    """A read-only plan saving at every fragmented and whole location, then generic edits; name -> tensor
    (pt2_plan_test.py runs it on .pt2 and TorchScript exports of the same weights, and at tp=1).

    Edits: add at a whole location, zero a slice of qkv across its q|k boundary, set a slice of gate|up
    across its boundary, scale a shard; and a logit lens call chain."""
    names = [name for name, kind, _ in model._c.locations() if kind != "rank_local"]
    out = {}
    with model.trace(ids):
        plain = model.output.save()
    with model.trace(ids):
        saved = {name: fragments.Location(model, name).save() for name in names}
        logits = model.output.save()
    out["plain"], out["read_only"] = plain.value, logits.value
    for name, value in saved.items():
        value = value.value
        if isinstance(value, list):  # not visited (an expert no token reached), or visited twice
            for k, v in enumerate(value):
                out[f"{name}#{k}"] = v
        else:
            out[name] = value
    m = model.model
    hidden = out["model.layers.0.output"].shape[-1]
    q = model._head_layout("model.layers.0.self_attn.qkv_proj.output")["q"]
    attn = m.layers[0].self_attn
    gate_up = "model.layers.0.mlp.gate_up_proj.output"
    if gate_up not in saved:
        gate_up = "model.layers.0.mlp.shared_expert.gate_up_proj.output"
    half = saved[gate_up].value.shape[-1] // 2
    with model.trace(ids):
        m.layers[0].output[:, -1] += _vector(hidden, 1).to(model.dtype)
        attn.qkv_proj.output[..., q[1] - 4:q[1] + 4] = 0
        fragments.Location(model, gate_up)[..., half - 3:half + 5] = 0.25
        m.layers[1].self_attn.o_proj.input[:, 1:3, :8] *= 0.5
        edited_resid = m.layers[1].output.save()
        lens = model.lm_head(m.norm(m.layers[0].output)).save()
        edited = model.output.save()
    out.update(edited=edited.value, edited_resid=edited_resid.value, lens=lens.value)
    return out


def every_location_on_rank(rank, path, ids):
    """every_location on this rank of a launched world (`path`: "dir/rank{rank}.pt2" or .pt)."""
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    return every_location(fragments.load(path), ids)


def scenarios_on_rank(rank, path, ids, other_ids):
    """scenarios on this rank of a launched world."""
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    return scenarios(fragments.load(path), ids, other_ids)


def every_location_on_torch_distributed(rank, path, ids):
    """every_location with torch.distributed set up first (init_process_group over launch's variables, so
    its rank 0 serves the one rendezvous): fragments joins its default group. Adds "process_group", the
    group fragments' context runs on."""
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    torch.distributed.init_process_group("gloo")
    try:
        out = every_location(fragments.load(path), ids)
        out["process_group"] = fragments.rank_context().process_group
    finally:
        torch.distributed.destroy_process_group()
    return out




def plan_changed_on_one_rank(rank, path, ids):
    """Two traces alike on both ranks (the second keeps its plan registered), then rank 1 changes its plan
    while rank 0 keeps its own: (each rank's error or "no error", seconds that third trace took)."""
    model = fragments.load(path)
    m = model.model

    def trace(more):
        with model.trace(ids):
            m.layers[0].output.save()
            if more:
                m.layers[1].output.save()

    trace(False)
    trace(False)
    started = time.monotonic()
    try:
        trace(rank == 1)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}", time.monotonic() - started
    return "no error", time.monotonic() - started

def replay_trace(model, ids, value):
    """gpu_trace_test's trace: an edit, a save at a fragmented location (whole at tp 1), a logit lens."""
    m = model.model
    with model.trace(ids):
        m.layers[0].output[:, -1] += value.to(model.dtype)
        o_in = m.layers[1].self_attn.o_proj.input.save()
        lens = model.lm_head(m.norm(m.layers[0].output)).save()
        logits = model.output.save()
    return o_in.value, lens.value, logits.value


# Nine traces over two plans: the first five times (captured on its third forward), another value three
# times (another plan, captured on its third), then the first again (its graph found in the cache).
REPLAY_ROUNDS = [0.5] * 5 + [-0.5] * 3 + [0.5]


def replay_rounds(rank, path, ids, width, device):
    """Each round traced on an eager model (cuda_graphs off) and on one that replays, on `device` ("{rank}"
    is replaced by the rank): every round's (eager, replayed) values on the CPU, and the replaying model's
    graph_stats()."""
    device = device.format(rank=rank)
    eager = fragments.load(path, device=device)
    eager.cuda_graphs = False
    graphed = fragments.load(path, device=device)
    ids = ids.to(device)
    rounds = []
    for value in REPLAY_ROUNDS:
        vector = torch.full((width,), value)
        expected = replay_trace(eager, ids, vector.clone())
        got = replay_trace(graphed, ids, vector.clone())  # a new tensor each time, equal bytes
        rounds.append(([t.cpu() for t in expected], [t.cpu() for t in got]))
    return rounds, graphed.graph_stats()
