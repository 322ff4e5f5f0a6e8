import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No test reaches a model hub: models are built here or shipped in models/, lm-eval's tasks read local JSONL.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Tests run on CPU: Triton kernels run in Triton's interpreter. Set before anything imports Triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from lanes.models import LoadedModel, build_random_model  # noqa: E402

torch.set_num_threads(1)

VOCAB = 128
_NO_SPECIAL = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
ARCH_CONFIGS = {
    "llama": dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **_NO_SPECIAL,
    ),
    "qwen2": dict(
        model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **_NO_SPECIAL,
    ),
}


def perturbed_copy(model: LoadedModel, scale: float, seed: int) -> LoadedModel:
    """A draft that agrees with the target often but not always: the target with noisy weights."""
    draft = copy.deepcopy(model.model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale * p.std())
    return LoadedModel(draft, None, f"{model.name}-perturbed")


def make_pair(arch: str, dtype: str = "float64", scale: float = 0.1) -> tuple[LoadedModel, LoadedModel]:
    target = build_random_model(ARCH_CONFIGS[arch], dtype=dtype, seed=1)
    return target, perturbed_copy(target, scale, seed=2)


@pytest.fixture(scope="session", params=sorted(ARCH_CONFIGS))
def pair(request) -> tuple[LoadedModel, LoadedModel]:
    return make_pair(request.param)


@pytest.fixture(scope="session")
def llama_pair() -> tuple[LoadedModel, LoadedModel]:
    return make_pair("llama")


@pytest.fixture(scope="module")
def pair_paths(tmp_path_factory) -> tuple[str, str]:
    """The tiny target and draft saved as model directories with a tokenizer, once per module."""
    from tests.tiny_pair import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def two_fake_gpus():
    """Ray with two logical GPUs (none need exist): where Ray places GPU replicas and what it tells them."""
    import ray

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def pytest_addoption(parser):
    parser.addoption("--module-durations", type=int, default=None, metavar="N",
                     help="print the N slowest test modules by wall time (setup, call and teardown; 0: all)")


_module_s: dict[str, list] = {}  # module path -> [tests, seconds]


def pytest_runtest_logreport(report):
    entry = _module_s.setdefault(report.nodeid.split("::")[0], [0, 0.0])
    entry[0] += report.when == "call" or (report.when == "setup" and report.skipped)
    entry[1] += report.duration


def pytest_terminal_summary(terminalreporter, config):
    count = config.getoption("--module-durations")
    if count is None or not _module_s:
        return
    rows = sorted(_module_s.items(), key=lambda kv: -kv[1][1])
    terminalreporter.write_sep("=", "wall time per module")
    for module, (tests, seconds) in rows[:count or None]:
        terminalreporter.write_line(f"{seconds:8.1f} s {tests:5d} tests  {module}")
    terminalreporter.write_line(f"{sum(s for _, s in _module_s.values()):8.1f} s in all")
