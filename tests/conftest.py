import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# 2 threads on an idle 2-core machine; DLM_TEST_THREADS=1 when the cores are shared (two OpenMP threads that wait on
# each other's time slices make tiny-model steps 10-100x slower under a load above 2), and always 1 in a pytest-xdist
# worker (`pytest -n 2`: the two workers are the two cores).
_default_threads = "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"
torch.set_num_threads(int(os.environ.get("DLM_TEST_THREADS", _default_threads)))


def pytest_configure(config):
    # pytest-xdist would otherwise queue the files by their number of tests, which puts the few long tests last
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The slow tests (learning and distributed, minutes each) first, the longest (`slow(minutes=N)`, the minutes
    one worker spends on the file) first of all, each file's order kept: under `pytest -n 2 --dist loadfile` one
    worker starts on the longest chain and the other takes the rest around it, instead of a long file starting last
    on its own."""
    def rank(item):
        slow = item.get_closest_marker("slow")
        return (slow is None, -(slow.kwargs.get("minutes", 1) if slow else 0))

    items.sort(key=rank)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from dlm.data.tokenizer import train_bpe_tokenizer

    texts = [f"user: Mia has {i} apples and {i + 3} pears.\nassistant: def solution():\n    apples = {i}\n"
             "    return apples"
             for i in range(300)]
    return train_bpe_tokenizer(texts, 300, cache_dir=tmp_path_factory.mktemp("tok"))


def tiny_model(vocab: int, attention: str = "causal", family: str = "autoregressive", label_shift: bool = False,
               seed: int = 0, arch: str = "llama", **spec):
    """A `nano` model through the one assembly path (`dlm.modeling.build`), with the extras its spec names; `spec`
    takes any other ModelSpec field (block-causal models default to blocks of 4)."""
    from dlm.modeling.build import build
    from dlm.modeling.spec import ModelSpec

    if attention == "block_causal":
        spec.setdefault("block_size", 4)
    torch.manual_seed(seed)
    model_spec = ModelSpec(family=family, attention=attention, label_shift=label_shift, **spec)
    return build(model_spec, arch=arch, preset="nano", vocab_size=vocab, max_positions=128).eval()



def perturb(m, seed: int = 1):
    """Large random weights (std 0.5 on every matrix) for tiny samplers' tests: varied tokens and confidences spread
    over (0.2, 0.9) instead of a near-uniform untrained model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m

class LogitRecorder(torch.nn.Module):
    """Wraps a backbone and keeps each forward's logits, so samplers' equivalence tests compare numbers, not only the
    tokens picked from them. Use it on a `perturb`-ed model: an untrained nano model's outputs barely depend on
    position (an off-by-one position id moves its logits by ~4e-4), a perturbed one's by several units."""

    def __init__(self, backbone):
        super().__init__()
        self.inner = backbone
        self.logits: list[torch.Tensor] = []

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.logits.append(out.logits.detach().float().clone())
        return out


@pytest.fixture
def one_thread():
    """Tiny models are latency-bound: one torch thread is faster, and much faster when the 2 cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def revealing_steps(trace, row: int, width: int) -> torch.Tensor:
    """[steps, width]: the confidences over the last `width` positions (the generated region) of one row, at each
    step in which that row revealed something. Implementations may schedule a batch's steps differently (a KV-cached
    sampler spends a batch step on a row's block switch), but each row's sequence of reveals must be the same."""
    rows = [s["confidence"][row, -width:].float() for s in trace if s["revealed"][row].any()]
    return torch.stack(rows) if rows else torch.zeros(0, width)


def assert_same_confidences(a, b, width: int, rows: tuple[int, int] | None = None):
    """Two generations' traces reveal with the same confidences, step by step, within float tolerance (rows: the
    row of `a` and of `b` to compare; default every row of both)."""
    pairs = [rows] if rows is not None else [(r, r) for r in range(len(a.tokens))]
    for ra, rb in pairs:
        ca, cb = revealing_steps(a.trace, ra, width), revealing_steps(b.trace, rb, width)
        torch.testing.assert_close(ca, cb, rtol=1e-3, atol=1e-4,
                                   msg=lambda m, ra=ra: f"row {ra}: confidences differ: {m}")


def assert_batched_equals_one_by_one(generate, model, prompts, *args, **kwargs):
    """Batched generation over prompts of different lengths gives each row exactly what it gets alone (tokens, NFE)
    and the same confidences at each reveal (within float tolerance): a row's numbers, not only its argmax, must not
    depend on its neighbours or its padding."""
    batched = generate(model, prompts, *args, return_trace=True, **kwargs)
    for row, (p, toks, nfe) in enumerate(zip(prompts, batched.tokens, batched.nfe)):
        alone = generate(model, [p], *args, return_trace=True, **kwargs)
        assert (alone.tokens[0], alone.nfe[0]) == (toks, nfe)
        width = alone.trace[0]["confidence"].shape[1] - len(p)  # the generated region closes every canvas
        assert_same_confidences(batched, alone, width, rows=(row, 0))


def tiny_mdm_warm_start(tmp_path):
    """(warm start run dir, data dir): one update of a tiny MDM on a small tinymath easy split, the shared start of
    the study-driver tests."""
    from pathlib import Path

    from dlm.config import load_recipe
    from dlm.training import loop

    data = tmp_path / "data"
    root = Path(__file__).resolve().parents[1]
    warm = loop.train(load_recipe(root / "recipes" / "tinymath" / "mdm.yaml", [
        f"data.dir={data}", "data.level=easy", "data.n_train=64", "data.n_validation=4", "data.n_test=6",
        "model.init_from=null", "model.preset=tiny", "model.vocab_size=300", "model.max_length=160",
        "model.label_shift=false", "train.batch_size=4", "train.steps=1", "eval.n=2", "eval.test_n=2",
        "eval.max_new_tokens=16", f"out_dir={tmp_path / 'warm'}"]), progress=False)
    return warm, data


@pytest.fixture
def spy(monkeypatch):
    """Record the keyword arguments the masked sampler is called with (it still runs)."""
    import dlm.sampling.masked as masked

    calls, real = [], masked.generate

    def record(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(masked, "generate", record)
    return calls
