import os

# Inductor's CPU kernels without SIMD code: the tests compare compiled steps with eager ones and read the
# graphs' buffers, not the kernels' vector code, and a cold compile of the compiled step took 31 s instead of
# 46 s. Set before torch is imported, so that the sweeps and notebooks the tests start inherit it too.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from medddpm.model import ModelSpec


# With pytest-xdist's workers (scripts/test.sh) the cores are shared out among them.
THREADS = int(os.environ.get("OMP_NUM_THREADS") or 2)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(THREADS)


@pytest.fixture
def tiny_spec() -> ModelSpec:
    """Two levels, 32 base channels, attention at downsample 2: the reference's shape, tiny."""
    return ModelSpec(size=16, mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=(2,))


def random_batch(spec: ModelSpec, *, batch: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = spec.size
    image = torch.rand(batch, 1, s, s, s, generator=g) * 2 - 1
    labels = torch.randint(0, spec.mask_channels + 1, (batch, s, s, s), generator=g)
    cond = torch.stack([(labels == k + 1).float() * 2 - 1 for k in range(spec.mask_channels)], dim=1)
    return image, cond


class Pairs(torch.utils.data.Dataset):
    """A tiny in-memory data set of random (image, label one-hot) pairs."""

    def __init__(self, spec, n=4):
        self.items = [tuple(t[0] for t in random_batch(spec, seed=i)) for i in range(n)]
        self.mask_channels = spec.mask_channels

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.fixture
def fresh_inductor():
    """Compile for real: Inductor's on-disk caches (kept across processes) would hand back a graph
    compiled before, without running the graph passes. The config modules' own patch(): pytest's
    monkeypatch deletes their entries on undo, which breaks every later compile in the process."""
    import torch._functorch.config
    import torch._inductor.config

    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
