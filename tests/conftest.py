import pytest
import torch

# Tiny models run fastest on one thread, and a second thread only fights the other
# core; the suite's results do not depend on it.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _private_cache(request, monkeypatch, tmp_path_factory):
    """What hasten caches (cost calibrations, GGUF conversions) goes to the session's temporary
    folder, never the user's ~/.cache/hasten; the opt-in real-model tests keep the user's
    cache, where a conversion takes a minute once."""
    if request.node.get_closest_marker("real") is None:
        monkeypatch.setenv("HASTEN_CACHE", str(tmp_path_factory.getbasetemp() / "hasten-cache"))


@pytest.fixture(autouse=True)
def _no_vllm_unless_asked(request, monkeypatch, tmp_path_factory):
    """hasten bench's automatic baselines include vLLM wherever its environment exists
    (.venv-vllm after `make vllm`); the suite starts it only in tests marked ``vllm``."""
    if request.node.get_closest_marker("vllm") is None:
        monkeypatch.setenv("HASTEN_VLLM_PYTHON", str(tmp_path_factory.getbasetemp() / "no-vllm" / "python"))


@pytest.fixture(autouse=True, scope="session")
def _float32_machine():
    """``--dtype auto`` picks bfloat16 on CPUs with native bfloat16 instructions: the suite's
    commands and loads run as on a CPU without them, whatever machine runs it (test_api_cli and
    test_dtype_rule check both). Session-wide, so a module's fixtures load as its tests do."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("hasten.arguments.native_bfloat16", lambda: None)
        yield


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
