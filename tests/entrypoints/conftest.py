"""Fixtures of the server tests: the tiny checkpoint with a chat template."""

import os
import shutil

import pytest
from server_helpers import CHAT_TEMPLATE


@pytest.fixture(scope="module")
def model_dir(tiny_dir, tmp_path_factory):
    """The tiny Llama checkpoint with CHAT_TEMPLATE as its chat_template.jinja."""
    d = str(tmp_path_factory.mktemp("served") / "tiny-chat")
    shutil.copytree(tiny_dir("llama"), d)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    return d
