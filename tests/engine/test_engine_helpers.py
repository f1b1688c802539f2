"""The engine tests' own helpers, by hand."""

import torch
from engine_helpers import first_flip


def test_first_flip_names_the_position_tokens_and_reference_margin():
    seen = []

    def logits(ids):  # the reference's logits over ids: 3 rows of a 10-token vocabulary
        seen.append(list(ids))
        out = torch.zeros(len(ids), 10)
        out[-1, 9], out[-1, 6] = 2.0, 1.5
        return out

    msg = first_flip(logits, [1, 2], [5, 6, 7], [5, 9, 7])
    # the reference was fed the prompt and its own tokens before the flip
    assert seen == [[1, 2, 5]]
    assert msg == ("first flip at output position 1: ours 6, reference 9, reference logit "
                   "margin 0.5 (its top-1 2)")
    assert first_flip(logits, [1], [3, 4], [3, 4]) == "" and len(seen) == 1
    assert first_flip(logits, [1], [3], [3, 4]) == "lengths 1 / 2"
