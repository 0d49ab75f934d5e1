"""Markup in the data, and the check that a page shows it as text.

`poison` writes `PAYLOAD` after every string cell of every table under a folder (inside JSON cells, after each
string value), and into a stored notebook's outputs: a script, an image whose error handler sets
``window.__pwned``, a `javascript:` link, and the Markdown that would slant, link, set as code, open a MyST role,
math or a table row, or read an entity. `poison_source_gpu` makes the first GPU with counters of a copy of data/ one
whose device name is markup (`LABEL_PAYLOAD`, the name the pages give the card), with every kind of table the pages
read, a lever call's among them. `problems` reads a page's HTML (a built page, or a page's output as the book renders
it) and names every place where a payload is markup, or is shown as other than its whole literal text.

Not poisoned (`kept`), each with why: the values a table's schema allows by name (`schema.ENUMS`: anything else is
refused on reading), the columns the loader holds against the folder a row is in (its label, device type,
configuration and preset: a label is lower-case letters, digits and hyphens, or its folder is left out, so the
device name carries markup instead), and the values the pages read for their meaning (`READ`: another value there
is no measurement the pages know, and their checks stop the build).
"""

from __future__ import annotations

import html
import json
import math
import re
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa

from medddpm.store import schema
from medddpm.store.layout import NOTEBOOK_FILE, table_of

PAYLOAD = ("<script>window.__pwned=1</script><img src=x onerror=window.__pwned=2> *pwn* _pwn_ "
           "[pwn](javascript:window.__pwned=3) `pwn` {eval}`pwn` $pwn$ |pwn| \\pwn &amp;")
LABEL_PAYLOAD = "pwn<img src=x onerror=window.__pwned=4> *pwn* [pwn](javascript:window.__pwned=5) `pwn` $pwn$"
FLAG = "__pwned"  # what the payloads' scripts set on `window`: never set in a reader's browser

FOLDER_BOUND = ("run_id", "gpu_slug", "config", "preset")
# A label is its device type, or the type and its host (`<gpu_type>-<host>`): where the two agree, the pages name
# the card by its device name (`tables.card_names`), which carries the markup.
TYPE_BOUND = ("gpu_type",)
READ = {
    "run": {"backend_flags": "math modes the pages check by name", "shape": "an input shape the claims parse",
            "precision_used": "the precision a step ran in, which picks the card's roof it is read against"},
    "kernels": {"category": "a kernel category the pages select by name"},
    "ncu": {"metric": "a counter the pages read by name", "section": "the section whose rules the claims read"},
    "bench": {"implementation": "ours or the reference's, set side by side by name"},
    "partition": {"config": "a traced configuration, checked against today's definition",
                  "switches": "its switches when traced, checked against today's definition"},
}
# The book reads every table but the allocator snapshot's summary, which `bench --memory-snapshot` writes beside
# the snapshot in a folder of the user's, outside the data tree.
NOT_READ = ("snapshot",)


def kept(table: str) -> dict[str, str]:
    """The string columns of `table` that `poison` leaves as they are, with why."""
    out = {c: "an enum of the schema: any other value is refused on reading" for c in schema.ENUMS.get(table, {})}
    out |= {c: "named by the row's folder (a label is lower-case letters, digits and hyphens; the device name "
               "carries markup instead)" for c in FOLDER_BOUND if c in schema.TABLES[table]}
    out |= {c: "the label is made of it, and the card is named by its device name only where the two agree"
            for c in TYPE_BOUND if c in schema.TABLES[table]}
    return out | READ.get(table, {})


def _poison_json(text: str) -> str:
    def walk(v):
        if isinstance(v, str):
            return v + PAYLOAD
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    try:
        return json.dumps(walk(json.loads(text))) if text else text
    except ValueError:
        return text + PAYLOAD


def poison_table(path: Path) -> None:
    table = table_of(path)
    df = schema.read_table(path, table)
    skip = kept(table)
    for column, (typ, meaning) in schema.TABLES[table].items():
        if typ != pa.string() or column in skip or column not in df:
            continue
        if meaning.startswith("JSON"):
            df[column] = df[column].map(_poison_json)
        else:
            df[column] = df[column].astype(str) + PAYLOAD
    schema.write_table(df, path, table)


def poison_notebook(path: Path) -> None:
    """A stored notebook given outputs of every kind the appendix renders, each holding markup: HTML, Markdown with
    raw HTML and a `javascript:` link (a notebook's Markdown is rendered, without either), an image's bytes that
    would end its attribute, a stream."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    cell = next(c for c in nb["cells"] if c.get("cell_type") == "code")
    cell.setdefault("outputs", []).extend([
        {"output_type": "display_data", "metadata": {}, "data": {"text/html": PAYLOAD}},
        {"output_type": "display_data", "metadata": {},
         "data": {"text/markdown": f"<script>window.{FLAG}=7</script> [pwn](javascript:window.{FLAG}=8)"}},
        {"output_type": "display_data", "metadata": {}, "data": {"image/png": f'x" onerror="window.{FLAG}=6'}},
        {"output_type": "stream", "name": "stdout", "text": PAYLOAD + "\n"}])
    path.write_text(json.dumps(nb), encoding="utf-8")


def poison(folder: Path) -> int:
    """Every table and stored notebook under `folder` (a label's folder, or a data root) poisoned; how many
    tables."""
    visible = [p for p in sorted(Path(folder).rglob("*")) if not any(part.startswith(".") for part in p.parts)]
    for path in visible:
        if path.name == NOTEBOOK_FILE:
            poison_notebook(path)
    tables = [p for p in visible if p.suffix == ".parquet"]
    for path in tables:
        poison_table(path)
    return len(tables)


def add_failed_run(gpu: Path, config: str, group: str = "") -> None:
    """A run of `config` under the label folder `gpu` (in its `group` folder: ablation) that ran out of memory in
    its first step, in the environment and on the input of the label's baseline."""
    from medddpm.configs import get_config
    from medddpm.measure.run import run_row

    base = schema.read_table(gpu / "baseline" / "run.parquet", "run").iloc[0]
    row = run_row(get_config(config), base["preset"], env=base.to_dict(), gpu_name=base["gpu_name"], status="oom",
                  message="torch.OutOfMemoryError: CUDA out of memory", group=group)
    row |= {"run_id": row["run_id"].replace(row["gpu_slug"], gpu.name, 1), "gpu_slug": gpu.name,
            **{k: base[k] for k in ("gpu_type", "host", "size", "shape", "mask_channels", "parameters")}}
    folder = gpu / group / config
    folder.mkdir(parents=True)
    schema.write_table(pd.DataFrame([row]), folder / "run.parquet", "run")


def poison_gpu(gpu: Path) -> None:
    """A label folder's tables and notebooks poisoned, after a run that failed is added to it (its message is
    shown only for a run that did not finish)."""
    add_failed_run(gpu, next(c for c in FAILED_RUNS if not (gpu / c).exists()))
    poison(gpu)


# --- a committed GPU, every string of it markup ---------------------------------------------------------

SOURCE = "nvidia-h200"  # the committed GPU with counters, an ablation and bench timings beside its sweep
FAILED_RUNS = ("sdpa", "graphs", "compile")  # configurations of a run that ends in an error
FAILED_LEVER = "best+recompute_attention=true"
LEVER = "best+tap_major=true"  # the variant of a lever call, faster than best beyond its spread


def add_lever_call(gpu: Path) -> None:
    """A lever call under the label folder `gpu`: blocks of best and `LEVER` interleaved, the variant faster
    beyond the spread of best's, in training and in sampling; sampling by batch (one batch that ran out of
    memory); and each one's kernels and quality (best's committed ones)."""
    from medddpm.store.layout import levers_table

    base = schema.read_table(gpu / "best" / "run.parquet", "run").iloc[0]
    rows = []
    for phase, ms in (("train", base["train_median_ms"]), ("sample", base["train_median_ms"] / 4)):
        for i, config in enumerate(["best", LEVER] * 3 + ["best"]):
            block = ms * (0.9 if config == LEVER else 1 + 0.001 * i)
            rows.append({"call_id": f"{gpu.name}/levers/1", "gpu_slug": gpu.name, "gpu_name": base["gpu_name"],
                         "config": config, "phase": phase, "batch": 1, "size": int(base["size"]),
                         "position": i + (7 if phase == "sample" else 0), "repeat": i // 2, "steps": 10,
                         "block_ms": block, "block_p10_ms": block * 0.99, "block_p90_ms": block * 1.01,
                         "peak_mem_bytes": 1, "first_step_s": 1.0, "git_commit": base["git_commit"],
                         "torch": base["torch"], "cudnn": base["cudnn"], "start_time": base["start_time"]})
    path = levers_table(gpu.parent, gpu.name, "repeats")
    path.parent.mkdir(parents=True)
    schema.write_table(pd.DataFrame(rows), path, "repeats")
    batches = [{"call_id": f"{gpu.name}/levers/1", "gpu_slug": gpu.name, "gpu_name": base["gpu_name"], "config": LEVER,
                "size": int(base["size"]), "batch": b, "status": status, "message": message, "timesteps": 250,
                "steps": 4, "step_median_ms": ms, "step_p10_ms": ms, "step_p90_ms": ms, "volume_s": 250 * ms / 1e3 / b,
                "peak_mem_bytes": 1, "git_commit": base["git_commit"], "torch": base["torch"],
                "start_time": base["start_time"]}
               for b, status, message, ms in ((1, "ok", "", 40.0),
                                              (2, "oom", "torch.OutOfMemoryError: CUDA out of memory", math.nan))]
    schema.write_table(pd.DataFrame(batches), levers_table(gpu.parent, gpu.name, "sample_batches"), "sample_batches")
    for config in ("best", LEVER):
        for table in ("kernels", "quality"):
            to = levers_table(gpu.parent, gpu.name, table, config)
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(gpu / "best" / f"{table}.parquet", to)


def poison_source_gpu(root: Path) -> Path:
    """The first GPU with counters of a data tree `root` (a copy of data/), `SOURCE`, given what it lacks of the
    tables the book reads (an ablation lever that failed, a lever call, a scaling run, a convergence study with a
    diverged run), its device name made `LABEL_PAYLOAD` (its label is its device type: the pages name the card by
    that name), then every table of it poisoned, and the tree's traced partition too. Every page reads it where it
    reads one card (the claims' worked example, the card the others are predicted from) as where it reads them
    all. Returns its folder."""
    from conftest import relabel
    from test_convergence import fake_study

    from medddpm.store.layout import ABLATION_DIR, PARTITION_FILE, SCALING_DIR, convergence_folder

    gpu = root / SOURCE
    relabel(gpu, SOURCE, SOURCE, f"NVIDIA {LABEL_PAYLOAD}")
    scaling = next(root.glob(f"*/{SCALING_DIR}/*.parquet"))
    (gpu / SCALING_DIR).mkdir()
    shutil.copy(scaling, gpu / SCALING_DIR / scaling.name)
    relabel(gpu / SCALING_DIR, scaling.parent.parent.name, SOURCE)
    add_failed_run(gpu, FAILED_LEVER, ABLATION_DIR)
    add_lever_call(gpu)
    study = convergence_folder(root, SOURCE)
    fake_study(study, slug=SOURCE, diverged={"bf16": [1]})
    runs = schema.read_table(study / "runs.parquet", "convergence_runs")
    schema.write_table(runs.assign(gpu_slug=SOURCE), study / "runs.parquet", "convergence_runs")
    poison(gpu)
    poison_table(root / PARTITION_FILE)
    return gpu


# --- the check ----------------------------------------------------------------------------------------

# The payloads' markup as it would stand in a page's HTML had a value been pasted in unescaped (or rendered as
# Markdown): each is a problem wherever it appears.
MARKUP = {
    "<script>window.__pwned": "a script from the data",
    "<img src=x onerror=window.__pwned": "an image whose error handler runs, from the data",
    'href="javascript:window.__pwned': "a javascript: link from the data",
    'onerror="window.__pwned': "an attribute ended early by the data",
    "<em>pwn</em>": "Markdown emphasis from the data",
    "<code>pwn</code>": "a code span from the data",
    ">pwn</a>": "a Markdown link from the data",
}


def visible_text(page_html: str) -> str:
    """What a reader sees: the text without scripts, styles, comments and tags, entities read, white space as one
    space."""
    text = re.sub(r"<(script|style)\b.*?</\1\s*>", " ", page_html, flags=re.S | re.I)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())


def problems(page_html: str, where: str = "") -> list[str]:
    """Where `page_html` holds a payload as markup, or shows one other than as its whole literal text (or as the
    part before its first colon: a page may end a source's words there, as the intro's cost text does; or as
    Python's repr writes it, its backslashes doubled: a cell that shows an object, as the claims page shows a
    rule's verdict)."""
    out = []
    for token, what in MARKUP.items():
        if (i := page_html.find(token)) >= 0:
            out.append(f"{where}: {what}: ...{page_html[max(0, i - 120):i + 80]!r}")
    text = visible_text(page_html)
    for payload in (PAYLOAD, LABEL_PAYLOAD):
        whole = " ".join(payload.split())
        cut = whole[:whole.index(":")]
        for m in re.finditer(re.escape(whole[:24]), text):
            rest = text[m.start():]
            if not (rest.startswith((whole, whole.replace("\\", "\\\\")))
                    or rest.startswith(cut) and not rest.startswith(cut + ":")):
                out.append(f"{where}: a payload shown as other than its text: ...{rest[:len(whole) + 20]!r}")
                break
    return out


def shows(page_html: str, payload: str = PAYLOAD) -> bool:
    """Whether a reader sees `payload` as its whole text."""
    return " ".join(payload.split()) in visible_text(page_html)
