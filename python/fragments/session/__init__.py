"""The session backend, `fragments.LanguageModel`: a model kept loaded on rank processes, driven from any Python.

    language_model  LanguageModel (the driver), whole weights from the ranks' pieces
    trace           SessionTrace: recorded here, run on the ranks; invokes
    channel         Ranks: the driver's end of the rank processes (start, requests, replies, end)
    rank            `python -m fragments.session.rank`: one rank, running what the driver sends
    host, attach    ranks kept up for other processes (`python -m fragments.ranks`) and their clients
"""
