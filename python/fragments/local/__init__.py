"""The in-process backend, `fragments.load`: this rank's model in this process, its traces run by the C++ engine.

    model     Model, load
    trace     Trace (a recording run as one plan), the shape probe
    generate  Generation (prefill and decode steps through program::Decoder, sampling)
    run       Prepared: a recording as this rank's engine takes it (plan steps, callables, Hooks)
    launch    launch, rank_context: the ranks of this machine
    pt2_torch_export  Pt2Runner: a .pt2 run by torch.export under the C++ plan engine
"""
