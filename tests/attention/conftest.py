import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Small tensors run fastest single-threaded; the previous setting is restored after."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
