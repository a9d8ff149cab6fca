import pytest
import torch

# Tiny models run fastest on one thread, and a second thread only fights the other
# core; the suite's results do not depend on it.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield
