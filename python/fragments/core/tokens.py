"""Token ids as the forward takes them: [batch, tokens] LongTensors; prompts of different lengths right-padded."""
import torch

from .errors import FragmentsError

PAD_ID = 0  # the token a ragged batch is right-padded with (no real token attends to it: attention is causal)


def token_ids(ids):
    """A LongTensor [B, T] from a tensor or lists of ints ([T] becomes [1, T])."""
    if isinstance(ids, torch.Tensor):
        t = ids
    else:
        try:
            t = torch.tensor(ids, dtype=torch.long)
        except (TypeError, ValueError) as e:
            raise FragmentsError(f"token ids must be a LongTensor or lists of ints: {e}") from None
    if t.dtype != torch.long:
        raise FragmentsError(f"token ids must be integers (torch.long), got {t.dtype}")
    dim = t.dim()
    if dim == 1:
        t = t.unsqueeze(0)
    elif dim != 2:
        raise FragmentsError(f"token ids must be [batch, tokens] (or [tokens]), got shape {list(t.shape)}")
    return t.contiguous()


def token_rows(ids):
    """Token ids as rows of ints: a LongTensor [B, T] or [T], a list of ints, or lists of ints of any lengths
    (a ragged batch)."""
    if isinstance(ids, (list, tuple)) and ids and all(isinstance(r, (list, tuple, torch.Tensor)) for r in ids):
        rows = []
        for i, r in enumerate(ids):
            r = token_ids(r)
            if r.shape[0] != 1:
                raise FragmentsError(f"token ids: prompt {i} must be one row of ids, got shape {list(r.shape)}")
            rows.append(r[0].tolist())
    else:
        rows = token_ids(ids).tolist()
    return nonempty(rows, "token ids")


def nonempty(rows, what):
    """`rows`, each with at least one token (else a FragmentsError naming the prompt, after `what`)."""
    for i, r in enumerate(rows):
        if not r:
            raise FragmentsError(f"{what}: prompt {i} has no tokens")
    return rows


def padded(rows):
    """Rows of different lengths as one [B, longest] batch, right-padded with PAD_ID: each real token's position
    is its index, as in its own run, and causal attention keeps it from the pads after it."""
    longest = max(len(r) for r in rows)
    return torch.tensor([r + [PAD_ID] * (longest - len(r)) for r in rows], dtype=torch.long)


def batch(ids):
    """(ids [B, T] as the forward takes them, each row's length): a tensor as it is (no round trip through
    lists; C++ moves it to the model's device, ShardedModel::forward), lists of ids right-padded."""
    if isinstance(ids, torch.Tensor):
        ids = token_ids(ids)
        rows, tokens = ids.shape
        if tokens == 0:
            raise FragmentsError("token ids: prompt 0 has no tokens")
        return ids, [tokens] * rows
    rows = token_rows(ids)
    return padded(rows), [len(r) for r in rows]  # a ragged batch runs right-padded: see unpad()
