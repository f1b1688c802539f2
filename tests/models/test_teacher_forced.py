"""``teacher_forced_check`` / ``teacher_forced_checks`` (pagedkv.models.harness) on a bigram
model whose logits are a table, so every margin is computed by hand."""

import types

import pytest
import torch
from torch import nn

from pagedkv.models.harness import TeacherForcedCheck, teacher_forced_check, teacher_forced_checks

# row p: the logits of the token after token p
TABLE = [[0.0, 1.0, 3.0, 2.0],   # after 0: top-1 is 2
         [5.0, 0.0, 0.0, 0.0],   # after 1: top-1 is 0
         [0.0, 0.0, 0.0, 4.0],   # after 2: top-1 is 3
         [1.0, 1.0, 1.0, 1.5]]   # after 3: top-1 is 3


class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding.from_pretrained(torch.tensor(TABLE))

    def forward(self, ids):
        return types.SimpleNamespace(logits=self.table(ids))


def test_one_prompt_margins_by_hand():
    # prompt [1], ours [0, 1, 3]: after 1 the top-1 is 0 (ours: 0); after 0 it is 2 at 3.0,
    # ours 1 at 1.0; after 1 again 0 at 5.0, ours 3 at 0.0
    tf = teacher_forced_check(Bigram(), [1], [0, 1, 3])
    assert tf.margins == [0.0, 2.0, 5.0]
    assert (tf.exact, tf.max_margin, tf.count_over(1.0), tf.count_over(2.0)) == (1, 5.0, 2, 1)
    assert tf.mean_margin == pytest.approx(7.0 / 3)


def test_several_prompts_in_one_check():
    tf = teacher_forced_checks(Bigram(), [[1], [2], [0, 3]], [[0, 1, 3], [3], [0]])
    # [2] -> 3 is the top-1; [0, 3] -> after 3 the top-1 is 3 (1.5), ours 0 at 1.0
    assert tf.margins == [0.0, 2.0, 5.0, 0.0, 0.5]
    assert (tf.exact, tf.max_margin, tf.count_over(0.5)) == (2, 5.0, 2)
    assert tf.mean_margin == pytest.approx(1.5)
    with pytest.raises(ValueError):  # one output list per prompt
        teacher_forced_checks(Bigram(), [[1], [2]], [[0]])
    empty = TeacherForcedCheck([])
    assert (empty.exact, empty.max_margin, empty.mean_margin, empty.count_over(0.0)) == (0, 0.0, 0.0, 0)
