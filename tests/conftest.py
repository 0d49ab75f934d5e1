import fcntl
import json
import os
import re
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# Inductor's CPU kernels without SIMD code: the tests compare compiled steps with eager ones and read the
# graphs' buffers, not the kernels' vector code, and a cold compile of the compiled step took 31 s instead of
# 46 s. Set before torch is imported, so that the sweeps and notebooks the tests start inherit it too.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# Triton kernels (group_norm="triton") run in Triton's CPU interpreter: `triton.jit` picks it as it
# decorates, triton's own library functions when triton is first imported, so it is set before any import;
# Inductor's CPU code does not read it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from medddpm.model.unet import ModelSpec

# Time budgets (tests/budgets.py): a test that takes more CPU seconds than its budget fails. pytester runs
# test_budgets.py's suite.
pytest_plugins = ["budgets", "pytester"]
pytest.register_assert_rewrite("budgets")  # imported here first, for shared_budget
from budgets import shared_budget  # noqa: E402

# With pytest-xdist's workers (scripts/test.sh) the cores are shared out among them.
THREADS = int(os.environ.get("OMP_NUM_THREADS") or 2)


def pytest_collection_modifyitems(config, items):
    """The slow tests first (in their order), the unit tests after them: pytest-xdist's workers then start
    the long ones early and end on short ones, instead of one worker running a sweep alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # a stable sort


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(THREADS)


def run_folder(tmp_path_factory) -> Path:
    """The test run's temporary folder, which pytest-xdist's workers share (each has its own folder below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def _inductor_cache(tmp_path_factory):
    """One Inductor cache for the whole run, shared by pytest-xdist's workers and by every process a test starts
    (sweeps, notebook kernels, torchrun ranks): a C++ kernel or a graph that one test compiled is loaded, not
    compiled again, by the next test that needs it. The kernels are most of a cold compile's time (about 60 of a
    compiled lever test's 97 CPU seconds), and the compiled-step tests share many at 8^3 (`small_spec`). A fresh
    folder: nothing an earlier run or another checkout compiled is found, so a run costs what it costs on the CI
    machine. TORCHINDUCTOR_CACHE_DIR given to the run wins. Tests that must run Inductor's graph passes turn the
    graph caches off (`fresh_inductor`); the kernels stay cached, as their source is their key."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        folder = run_folder(tmp_path_factory) / "inductor"
        folder.mkdir(exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


@pytest.fixture
def tiny_spec() -> ModelSpec:
    """Two levels, 32 base channels, attention at downsample 2: the reference's shape, tiny."""
    return ModelSpec(size=16, mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=(2,))


@pytest.fixture
def small_spec() -> ModelSpec:
    """tiny_spec at 8^3, for steps in bfloat16 or float16 and compiled ones: on an AVX2-only CPU a bfloat16 3-D
    convolution is about 70x slower than a float32 one (a study's bf16 run took 150 s at 16^3, 9 s at 8^3), and
    Inductor's kernels at 8^3 are the ones the compiled-step tests share through the run's cache."""
    return ModelSpec(size=8, mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=(2,))


# Models of the compiled-step tests. Tracing, Inductor's code generation and its C++ kernels cost by the graph's
# operations, not its voxels: a cold compile of `compile+pin_layout=true` in float32 at 8^3 took 109 CPU seconds
# with small_spec's two levels and attention at the second, 87 with attention in the middle block only, 40 with one
# level. ONE_LEVEL has every kind of block but the down- and upsampling (stem, residual blocks, the middle block's
# attention, decoder blocks reading skips, the output convolution); TWO_LEVELS adds those.
ONE_LEVEL = ModelSpec(size=8, mask_channels=3, base_channels=32, channel_mult=(1,), attention_ds=())
TWO_LEVELS = ModelSpec(size=8, mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=())


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


# --- the book: built once a test run -------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
# The build's own cost: CPU seconds of scripts/book.sh and every process under it (the page kernels): 197 s
# for 14 pages on a 2-core development machine. Not its wall time: the suite's other
# worker shares the cores, and on the CI machine builds beside compiling tests took 286-326 s of wall time.
BUILD_CPU_LIMIT_S = 480
FAKE_SLUG, FAKE_NAME = "fake-gpu-x", "Fake GPU X"


def toc_pages() -> list[str]:
    """Document names from _toc.yml (jb-book: root, chapters or parts of chapters, nested sections)."""
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    names = [toc["root"]]

    def walk(entries):
        for e in entries or []:
            if "file" in e:
                names.append(e["file"])
            walk(e.get("sections"))

    walk(toc.get("chapters"))
    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    return [re.sub(r"\.(md|ipynb)$", "", n) for n in names]


def _children_cpu_s() -> float:
    """User + system seconds of this process's finished children (and theirs, once reaped)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_book_sh(out: Path, data: Path | None = None) -> tuple[subprocess.CompletedProcess, str, float, float]:
    """scripts/book.sh (set-up skipped: the test run has done it) into `out`; also its wall and CPU seconds."""
    env = dict(os.environ, BOOK_SKIP_SETUP="1", BOOK_OUT=str(out), MEDDDPM_DATA=str(data or REPO / "data"))
    t0, cpu0 = time.monotonic(), _children_cpu_s()
    proc = subprocess.run(["bash", str(REPO / "scripts/book.sh")], cwd=REPO, env=env, capture_output=True, text=True)
    return proc, proc.stdout + proc.stderr, time.monotonic() - t0, _children_cpu_s() - cpu0


def build_book(out: Path, data: Path | None = None) -> Path:
    """A build that must succeed within its CPU budget; returns the html folder."""
    proc, log, took, cpu = run_book_sh(out, data)
    if proc.returncode != 0:
        # The cause (the failing page and its cell error) first, then the end of the log.
        at = min((i for i in (log.find("CellExecutionError"), log.find(": WARNING:"), log.find(": ERROR:"),
                                  log.find("Sphinx parallel build error")) if i >= 0),
                 default=len(log))
        raise AssertionError(f"book build failed (rc {proc.returncode}):\n{log[max(0, at - 800):at + 4000]}\n"
                             f"[...]\n{log[-1500:]}")
    print(f"book built in {took:.1f} s, {cpu:.0f} CPU seconds ({out})")
    assert 0 < cpu < BUILD_CPU_LIMIT_S, f"book build took {cpu:.0f} CPU seconds (limit {BUILD_CPU_LIMIT_S} s)"
    html = out / "_build" / "html"
    for page in toc_pages():
        assert (html / f"{page}.html").is_file(), f"{page}.html missing from the build"
    return html


def add_fake_gpu(data: Path) -> str:
    """Copy the first GPU folder with parquet files to `fake-gpu-x`, renamed in every table; returns the
    copied folder's name. The CPU's folder only where no GPU has one: its kernel and step times are no GPU's
    (the pages check a GPU's, e.g. the share of the step its kernels keep it busy)."""
    from medddpm.store.layout import hidden, is_run

    sources = sorted((p for p in data.iterdir() if p.is_dir() and not hidden(p.name) and any(map(is_run, p.iterdir()))),
                     key=lambda p: (p.name == "cpu", p.name))
    assert sources, f"no <gpu>/<config>/run.parquet under {data}"
    src = sources[0]
    dst = data / FAKE_SLUG
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".*"))
    relabel(dst, src.name, FAKE_SLUG, FAKE_NAME)
    return src.name


def relabel(folder: Path, old: str, new: str, name: str | None = None) -> None:
    """Every table under `folder`, a copy of label `old`'s, rewritten as label `new`'s (and device `name`'s)."""
    from medddpm.store.layout import table_of
    from medddpm.store.schema import read_table, write_table

    for path in folder.rglob("*.parquet"):  # runs, scaling tables, and runs kept in tuning/ or reference/
        table = table_of(path)
        df = read_table(path, table)
        if "run_id" in df:
            df["run_id"] = df["run_id"].str.replace(f"{old}/", f"{new}/", n=1, regex=False)
        if "gpu_slug" in df:
            df["gpu_slug"] = new
        if "gpu_name" in df and name is not None:
            df["gpu_name"] = name
        write_table(df, path, table)


@pytest.fixture(scope="session")
def committed_data():
    """`report.load_all()` of the committed data/, read once a run for the tests that read it as it is: a test
    derives its own frames from it (`report.Data(**{**data.__dict__, ...})`), never changes them."""
    from medddpm import report

    return report.load_all(REPO / "data")


@dataclass(frozen=True)
class BuiltBook:
    html: Path  # the build's _build/html
    data: Path  # the data root it read: a copy of data/ with FAKE_SLUG added
    src: str  # the GPU folder FAKE_SLUG copies


@pytest.fixture(scope="session")
@shared_budget(600)  # 229-285 CPU seconds measured: every page executed, the HTML written
def built_book(tmp_path_factory) -> BuiltBook:
    """scripts/book.sh run once for the whole test run, on a copy of data/ with a second copy of its first
    GPU folder (FAKE_SLUG) added, every string of it and of its notebooks markup (`poison.poison_gpu`), and its
    first GPU with counters given every kind of table the book reads, every string of it markup too, its device
    name among them (`poison.poison_source_gpu`): the browser test opens every page of it, the second-GPU test
    reads its charts, the escape test reads every page's text. pytest-xdist's workers share it: the first to ask
    builds it under a lock into the run's temporary folder, the others take what it left there (the HTML, or the
    build's error)."""
    from poison import poison_gpu, poison_source_gpu

    root = run_folder(tmp_path_factory) / "book"
    root.mkdir(exist_ok=True)
    outcome = root / "outcome.json"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not outcome.exists():
            try:
                data = root / "data"
                shutil.copytree(REPO / "data", data, ignore=shutil.ignore_patterns(".*"))
                src = add_fake_gpu(data)
                poison_gpu(data / FAKE_SLUG)  # its strings markup, and a failed run: the pages must show them as text
                poison_source_gpu(data)
                html = build_book(root / "out", data)
            except BaseException as e:
                outcome.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
                raise
            outcome.write_text(json.dumps({"html": str(html), "data": str(data), "src": src}))
    done = json.loads(outcome.read_text())
    if "error" in done:
        raise AssertionError(f"the book's build failed in another worker: {done['error']}")
    return BuiltBook(Path(done["html"]), Path(done["data"]), done["src"])
