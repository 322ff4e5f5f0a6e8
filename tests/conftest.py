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

from lanes.model.loader import LoadedModel, build_random_model  # noqa: E402

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


@pytest.fixture(scope="session")
def pair_paths(tmp_path_factory) -> tuple[str, str]:
    """The tiny target and draft saved as model directories with a tokenizer, once per session."""
    from tests.tiny_pair import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def two_fake_gpus():
    """Ray with two logical GPUs (none need exist; on a machine with two, they are those): where Ray places
    GPU replicas and what it tells them."""
    from tests.serve_helpers import ray_cluster

    ray_cluster(num_gpus=2, with_serve=False)


# Tests that need a Ray cluster carry the `serve` mark (`-m "not serve"` is the quick tier). A whole
# session shares one cluster (tests/serve_helpers.py), so modules run grouped by the cluster they need,
# each group once: no cluster; two logical GPUs; Serve with apps kept for the next module of the group
# (`serve(shared_apps=True)`); Serve; a cluster of other settings (`serve(cluster=...)`), one module at a time.
def _cluster_group(item) -> int:
    mark = item.get_closest_marker("serve")
    if mark is None:
        return 0
    if "two_fake_gpus" in item.fixturenames:
        return 1
    if mark.kwargs.get("shared_apps"):
        return 2
    return 4 if mark.kwargs.get("cluster") else 3


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if "two_fake_gpus" in item.fixturenames:
            item.add_marker(pytest.mark.serve)
        # Under pytest-xdist (`-n 2 --dist loadgroup`, scripts/test.sh): every test that needs Ray runs in
        # one worker, in the order below, over the session's one cluster; the others go a module at a time
        # to whichever worker is free (a module's fixtures are built once). The Ray group, the largest,
        # is handed out first, so the other worker runs the rest beside it.
        group = "ray" if item.get_closest_marker("serve") else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
    group: dict[str, int] = {}
    for item in items:
        group[item.module.__name__] = max(group.get(item.module.__name__, 0), _cluster_group(item))
    items.sort(key=lambda item: group[item.module.__name__])  # stable: files and tests keep their order


def pytest_sessionfinish(session):
    import sys

    if "tests.serve_helpers" in sys.modules:  # Ray stays down where no served module was collected
        sys.modules["tests.serve_helpers"].stop_ray()


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
