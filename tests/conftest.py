import pytest
import torch

# Tiny models run fastest on one thread, and a second thread only fights the other
# core; the suite's results do not depend on it.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture
def cli(capsys):
    """Run the hasten command in-process (fast); returns (exit status, stdout, stderr)."""
    from hasten.cli import main

    def run(*args):
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's own errors
            code = exit.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
