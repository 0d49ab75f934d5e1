"""The GPU work still owed, as one ordered queue that any call on either card advances (lab/leases/queue.sh).

`ITEMS` is the order, one line an item. An item is owed until its results are in the data tree (a sweep's run of
the identity it measures, `medddpm.measure.sweep.measured_before`; the study's finished seeds; counters covering
85% of a step), or, for one whose record lives in lab/, until that record is committed; runs added from elsewhere
(`python -m medddpm add-runs`) count like the queue's own. A call does the next owed items that fit the seconds left
(an item bound to the other card is skipped with that reason), packs each one as it ends into $OUT, and prints what
it did, what it skipped and why, and what is left, in minutes. Every estimate names where it comes from.

On the machine the items write into runs/queue/data (a copy of data/, made once per machine), not data/: the working
tree that each call copies in would replace a folder under data/ being written. Unpack what comes back from the
repository root (`tar -xzf NN-item.tgz`, in their order): paths are data/... and lab/...

    python3 lab/leases/tools/lease_queue.py run        (lab/leases/queue.sh: LIMIT, COMMIT; CARD overrides the card)
    python3 lab/leases/tools/lease_queue.py plan       (DRY_RUN=1: the order, the skips and the minutes, on the CPU)
"""

from __future__ import annotations

import glob
import json
import math
import os
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

H100, H200 = "nvidia-h100-80gb-hbm3", "nvidia-h200"
CARDS = (H100, H200)
WORK = Path("runs/queue")
DATA_OUT = WORK / "data"  # the machine's data tree: a copy of data/ the items add to
LAB_OUT = WORK / "lab"  # what the items leave for lab/ (the repeats)
DONE = WORK / "done"  # items finished on this machine whose record lives in lab/
START_S = 40  # a sweep invocation's start (papermill, the kernel, imports): the H100 sweep's gaps between runs, 25-43 s
PACK_S = 15  # kept back from each item's deadline to pack it
# what the lease scripts pack of their own into their OUT that the item's tarball holds already (or autotune.tgz)
COPIES = {"data.tgz", "convergence.tgz", "ablation.tgz", "end-to-end.tgz", "counters.tgz", "autotune.tgz"}
TARBALLS = 6  # $OUT holds the log, autotune.tgz and these: the first five items one each, the rest together
OTHER_CARD = 1.1  # an estimate from the other card's row: the H100 took 1.02-1.15x the H200's step (gpu-runs README)
PHASES = "sample,torch,quality"  # the phases of the H100's committed runs: counters are items of their own


def other(card: str) -> str:
    return H200 if card == H100 else H100


# --------------------------------------------------------------------------------------------- the data tree


class Tree:
    """What is done: the committed data/ and lab/, and on a machine what earlier calls left under runs/queue."""

    def __init__(self, commit: str):
        self.commit = commit
        self.data = [Path("data")] + ([DATA_OUT] if DATA_OUT.is_dir() else [])
        self.lab = [Path("lab")] + ([LAB_OUT] if LAB_OUT.is_dir() else [])

    def row(self, label: str, folder: str):
        """The run row of data/<label>/<folder>, from the first tree that has it; None where none has."""
        from medddpm.store import schema

        for root in self.data:
            path = root / label / folder / "run.parquet"
            if path.is_file():
                return schema.read_table(path).iloc[0]
        return None

    def measured(self, configs: list[str], *, preset: str, label: str, params: dict | None = None, group: str = "",
                 roots: list[Path] | None = None) -> set[str]:
        """The configurations a sweep of these would skip in any of the trees."""
        from medddpm.measure.sweep import measured_before

        found = set()
        for root in roots or self.data:
            found |= {c for c, f in measured_before(",".join(configs), preset=preset, gpu_label=label, out=root,
                                                     params=params, group=group).items() if f is not None}
        return found

    def rest_s(self, compiled: bool) -> tuple[float, str]:
        """What a sweep run takes past its warm-up and sample (timed steps, the kernel breakdown, quality): the
        median over the H100's committed runs without counters."""
        import statistics

        rest = [r["duration_s"] - r["warmup_s"] - r["sample_total_s"] for c in ("baseline", "opt1", "opt2", "opt12",
                                                                                   "bf16", "fp16", "best")
                if (r := self.row(H100, c)) is not None and bool(r["compile"]) == compiled]
        return (statistics.median(rest), f"the H100's {'compiled' if compiled else 'eager'} runs' rest") if rest else \
            (100.0 if compiled else 40.0, "a guess")

    def sweep_s(self, card: str, preset: str, config: str, *, ref: str = "", phases: str = PHASES) -> tuple[float, str]:
        """A sweep run's seconds, from the committed row of `ref` (default: the configuration) on this card, else
        on the other."""
        from medddpm.store.layout import run_folder

        name = ref or config
        for label in (card, other(card)):
            r = self.row(label, run_folder(name, preset))
            if r is not None:
                break
        else:
            return 300.0, f"no row of {name}@{preset}: a guess"
        where = f"{label}/{run_folder(name, preset)}"
        if not phases:
            s, how = r["warmup_s"] + r["timed_steps"] * r["train_median_ms"] / 1e3, "warmup_s + timed steps"
        elif json.loads(r["profilers"] or "{}").get("ncu", {}).get("status") != "ok":
            s, how = r["duration_s"], "duration_s"
        else:  # its duration holds Nsight Compute's pass, which these runs leave out
            rest, why = self.rest_s(bool(r["compile"]))
            s, how = r["warmup_s"] + r["sample_total_s"] + rest, f"warmup_s + sample_total_s + {rest:.0f} s ({why})"
        s = (s * (OTHER_CARD if label != card else 1)) + START_S
        return s, f"{where} {how}{f' x{OTHER_CARD}' if label != card else ''} + {START_S} s start"


# -------------------------------------------------------------------------------------------------- the items


@dataclass
class State:
    done: str = ""  # why it is not owed ('' while it is)
    seconds: float = 0.0  # what is owed, estimated
    source: str = ""  # where the estimate comes from
    start_s: float = 0.0  # a resumable item starts with this much left and packs what it finished; 0: whole only


@dataclass
class Item:
    name: str
    card: str | None  # the label it must run on; None: either card (the machine's own label)

    def state(self, tree: Tree, label: str) -> State:
        raise NotImplementedError

    def command(self, tree: Tree, label: str) -> str:
        """bash, run from the repository root with DEADLINE (seconds it may take), OUT and ITEM_OUT (its own folder,
        packed with it), LABEL and COMMIT set."""
        raise NotImplementedError

    def packs(self, tree: Tree, label: str) -> list[Path]:
        """What it made, to pack (besides its logs)."""
        return []

    @property
    def marker(self) -> Path:
        return DONE / self.name

    def recorded(self, rc: int, logs: Path) -> bool:
        """Whether a run that ended with `rc` leaves its record in `logs` (an item whose record lives in lab/ is then
        not run again on this machine)."""
        return False


@dataclass
class Roofs(Item):
    def state(self, tree, label):
        if any((root / label / "roofs.parquet").is_file() for root in tree.data):
            return State(done=f"{label}/roofs.parquet is in data/")
        return State(seconds=90, source="the issue: about a minute")

    def command(self, tree, label):
        return f"python3 -m medddpm roofs --out {DATA_OUT} --gpu-label {label}"

    def packs(self, tree, label):
        return [DATA_OUT / label / "roofs.parquet"]


@dataclass
class Resume(Item):
    config: str = "opt1"
    seconds: float = 150
    source: str = ""

    def state(self, tree, label):
        records = [p for root in tree.lab
                   for p in glob.glob(str(root / "logs" / "**" / f"*resume-floor-{self.config}*.json"), recursive=True)
                   if self._on_a_gpu(Path(p))]
        if records:
            return State(done=f"its record on a GPU is committed ({records[0]})")
        if self.marker.exists():
            return State(done="recorded by an earlier call on this machine")
        return State(seconds=self.seconds, source=self.source)

    @staticmethod
    def _on_a_gpu(path: Path) -> bool:
        try:
            records = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        return any(r.get("device", "cpu") != "cpu" and "error" not in r for r in records if isinstance(r, dict))

    def command(self, tree, label):
        return (f"CONFIGS={self.config} bash lab/leases/2026-12-07-resume-floor.sh; "
                f"python3 lab/leases/tools/resume_floor.py judge $ITEM_OUT/resume-floor-{self.config}.json")

    def recorded(self, rc, logs):
        return self._on_a_gpu(logs / f"resume-floor-{self.config}.json")


@dataclass
class Study(Item):
    configs: tuple[str, ...] = ()
    jobs: int = 4
    seeds: int = 5
    # seconds of one optimizer step at 64^3 (lab/notebook/leases.md 2026-12-06: baseline an H100 trial, the rest
    # predictions), and a compiled configuration's compilation
    STEP_MS = {"baseline": 110, "opt1": 32, "bf16": 25, "fp16": 25, "best": 9}
    STEPS = 4000
    COMPILE_S = 120
    SAMPLE_S = 30  # four samples of 250 denoising steps at 64^3, scored

    def _done(self, tree, label) -> set[tuple[str, int]]:
        from medddpm.store import convergence

        done = set()
        for root in tree.data:
            runs = convergence.read(root / label / "convergence", "runs")
            done |= set(zip(runs[runs["status"].isin(convergence.DONE)]["config"],
                            runs[runs["status"].isin(convergence.DONE)]["seed"].astype(int)))
        return done

    def run_s(self, tree, label, config) -> tuple[float, str]:
        from medddpm.configs import get_config
        from medddpm.store import convergence

        for root in tree.data:
            runs = convergence.read(root / label / "convergence", "runs")
            mine = runs[(runs["config"] == config) & (runs["status"] == "ok")]
            if len(mine):
                return float((mine["train_s"] + mine["sample_s"]).median()), f"{label}'s finished {config} runs"
        s = self.STEPS * self.STEP_MS[config] / 1e3 + self.SAMPLE_S + (self.COMPILE_S if get_config(config).compile else 0)
        return s, f"leases.md 2026-12-06: {self.STEP_MS[config]} ms a step"

    def state(self, tree, label):
        done = self._done(tree, label)
        owed = [(c, s) for c in self.configs for s in range(self.seeds) if (c, s) not in done]
        if not owed:
            return State(done=f"{len(self.configs) * self.seeds} runs finished in {label}/convergence")
        per = {c: self.run_s(tree, label, c) for c in dict.fromkeys(c for c, _ in owed)}
        # parallel runs share the GPU by time-slicing: their times add up (leases.md 2026-12-06)
        seconds = sum(per[c][0] for c, _ in owed) + 20
        source = f"{len(owed)} runs owed; " + "; ".join(f"{c} {s:.0f} s a run ({why})" for c, (s, why) in per.items())
        return State(seconds=seconds, source=source, start_s=min(s for s, _ in per.values()) + 60)

    def command(self, tree, label):
        # parallel runs share the GPU by time-slicing, so n at once end together after n runs' time, and a run still
        # going when the call ends is lost with a fresh machine: as many at once as end before the deadline
        run_s = int(max(self.run_s(tree, label, c)[0] for c in self.configs))
        return (f"LIMIT=$((DEADLINE - 40)) CONFIGS={','.join(self.configs)} STUDY_OUT={DATA_OUT} "
                f"JOBS=$(( j = (DEADLINE - 60) / {run_s}, j < 1 ? 1 : (j > {self.jobs} ? {self.jobs} : j) )) "
                "bash lab/leases/2026-12-06-study.sh")

    def packs(self, tree, label):
        return [DATA_OUT / label / "convergence"]


@dataclass
class Counters(Item):
    config: str = ""
    COVERAGE = 0.85
    SECONDS = {"opt2": (471, "leases.md: opt2's counters, 471 s in one both pass"),
               "best": (510, "leases.md: a bench to fill Inductor's cache (best's warm-up 133 s on the H100), then a "
                             "both pass from it (best-ckpt's: 357 s)")}

    def coverage(self, tree, label) -> float:
        from medddpm.analysis.ncu_table import profiled_coverage
        from medddpm.store import schema

        got = 0.0
        for root in tree.data:
            run = root / label / self.config
            if (run / "ncu.parquet").is_file() and (run / "kernels.parquet").is_file():
                got = max(got, profiled_coverage(schema.read_table(run / "kernels.parquet"),
                                                 schema.read_table(run / "ncu.parquet")))
        return got

    def state(self, tree, label):
        if tree.row(label, self.config) is None:
            return State(done=f"no run of {self.config} on {label} to count yet")  # the paper sweep comes first
        got = self.coverage(tree, label)
        if got >= self.COVERAGE:
            return State(done=f"its counters cover {got:.0%} of the step")
        seconds, source = self.SECONDS.get(self.config, (400, "leases.md: a counters pass, 250-400 s"))
        return State(seconds=seconds, source=f"{source}; covered now {got:.0%}", start_s=250)

    def command(self, tree, label):
        from medddpm.configs import get_config

        warm = ""
        if get_config(self.config).compile:  # ncu's process then compiles from the cache, not under ncu
            warm = (f"[ -f runs/inductor/.warm-{self.config} ] || {{ bash lab/leases/tools/device-bench.sh "
                    f"$((DEADLINE / 3)) warm-{self.config} --size 128 --mask-channels 3 --warmup 2 --micro-steps 3 "
                    f"--configs {self.config} && touch runs/inductor/.warm-{self.config}; }}; ")
        return (f"{warm}COUNTERS_ARGS='--passes both --merge' bash lab/leases/tools/device-counters.sh "
                f"$((DEADLINE - SECONDS)) {DATA_OUT}/{label}/{self.config}")

    def packs(self, tree, label):
        return [DATA_OUT / label / self.config / f for f in ("run.parquet", "ncu.parquet")]


@dataclass
class Sweep(Item):
    preset: str = "paper"
    config: str = ""
    ref: str = ""  # the configuration whose committed row estimates this one, where it has none
    at_least: tuple[float, str] = (0, "")  # a floor on the estimate, and where it comes from

    def state(self, tree, label):
        if self.config in tree.measured([self.config], preset=self.preset, label=label, params={"phases": PHASES}):
            return State(done=f"{self.config}@{self.preset} of this identity is in {label}/")
        s, source = tree.sweep_s(label, self.preset, self.config, ref=self.ref)
        if s < self.at_least[0]:
            s, source = self.at_least[0], f"{self.at_least[1]} (from the rows: {s:.0f} s)"
        return State(seconds=s, source=source)

    def command(self, tree, label):
        return (f"SWEEP_OUT={DATA_OUT} SWEEP_ARGS='--phases {PHASES} --gpu-label {label}' "
                f"bash lab/leases/tools/device-sweep.sh $DEADLINE {self.preset} {self.config}")

    def packs(self, tree, label):
        from medddpm.measure.sweep import measured_before

        found = measured_before(self.config, preset=self.preset, gpu_label=label, out=DATA_OUT,
                                params={"phases": PHASES})[self.config]
        return [found] if found else []


@dataclass
class Ablation(Item):
    WARM_S = (330, "the ablation script's warm-up compiles (its cap; leases.md: about 340 s)")
    VARIANT_S = (65, "leases.md 2026-12-05: 55-70 s a variant from a warm cache")

    def owed(self, tree, label) -> list[str]:
        from medddpm.configs import ablation

        names = [c.name for c in ablation("best")]
        done = tree.measured(names, preset="paper", label=label, params={"phases": ""}, group="ablation")
        return [n for n in names if n not in done]

    def state(self, tree, label):
        owed = self.owed(tree, label)
        if not owed:
            return State(done=f"every variant is in {label}/ablation")
        warm = 0 if Path(f"runs/inductor/.warm-{label}").exists() else self.WARM_S[0]
        return State(seconds=warm + self.VARIANT_S[0] * len(owed), start_s=warm + self.VARIANT_S[0],
                     source=f"{len(owed)} variants owed; {self.WARM_S[1] if warm else 'cache warm'}; {self.VARIANT_S[1]}")

    def command(self, tree, label):
        return (f"LABEL={label} ABLATION_OUT={DATA_OUT} VARIANTS={shlex.quote(','.join(self.owed(tree, label)))} "
                "DEADLINE=$DEADLINE bash lab/leases/2026-12-04-ablation.sh")

    def packs(self, tree, label):
        return [DATA_OUT / label / "ablation"]


@dataclass
class EndToEnd(Item):
    def folders(self, roots: list[Path]) -> dict[str, list[Path]]:
        """Run folders trained from a NIfTI folder, by preset (another identity than its folder's default: <run>~<key>)."""
        from medddpm.store import schema

        found: dict[str, list[Path]] = {}
        for root in roots:
            for path in root.glob("*/*~*/run.parquet"):
                row = schema.read_table(path).iloc[0]
                if str(row["data_source"]).startswith("folder:") and row["status"] == "ok":
                    found.setdefault(row["preset"], []).append(path.parent)
        return found

    def state(self, tree, label):
        found = self.folders(tree.data)
        if {"paper", "brats"} <= set(found):
            return State(done=f"whole-head and BraTS folder runs are in data/ ({found['paper'][0].parent.name})")
        return State(seconds=540, start_s=300, source="export about 60 s; best's warm-up 118 s (paper) and 168 s "
                     "(brats) on the H200, 220 steps each, the loader's cache, two sweep starts")

    def command(self, tree, label):
        return f"DEADLINE=$DEADLINE E2E_OUT={DATA_OUT} LABEL={label} bash lab/leases/2026-12-05-end-to-end.sh"

    def packs(self, tree, label):
        return [p for folders in self.folders([DATA_OUT]).values() for p in folders]


@dataclass
class Repeat(Item):
    k: int = 1
    configs: tuple[str, ...] = ("baseline", "opt1", "best")
    SETS = 3

    def out(self, root: Path, commit: str, k: int) -> Path:
        return root / "tuning" / "repeats" / commit / f"r{k}"

    def owed(self, tree, label, commit: str, k: int) -> list[str]:
        done = set().union(*(tree.measured(list(self.configs), preset="paper", label=label, params={"phases": ""},
                                           roots=[self.out(root, commit, k)]) for root in tree.lab))
        return [c for c in self.configs if c not in done]

    def state(self, tree, label):
        commits = {Path(p).parent.name for root in tree.lab for p in glob.glob(str(self.out(root, "*", 1)))}
        for commit in sorted(commits):
            if not any(self.owed(tree, label, commit, k) for k in range(1, self.SETS + 1)):
                return State(done=f"{self.SETS} repeats of {', '.join(self.configs)} at {commit}")
        owed = self.owed(tree, label, tree.commit, self.k)
        if not owed:
            return State(done=f"repeat {self.k} at {tree.commit} is measured")
        parts = [tree.sweep_s(label, "paper", c, phases="") for c in owed]
        return State(seconds=sum(s for s, _ in parts), source="; ".join(why for _, why in parts))

    def command(self, tree, label):
        out = self.out(LAB_OUT, tree.commit, self.k)
        return (f"mkdir -p {out}/{label} && cp {DATA_OUT}/{label}/roofs.parquet {out}/{label}/ 2>/dev/null; "
                f"SWEEP_OUT={out} SWEEP_ARGS='--phases= --gpu-label {label}' "
                f"bash lab/leases/tools/device-sweep.sh $DEADLINE paper {' '.join(self.configs)}")

    def packs(self, tree, label):
        out = self.out(LAB_OUT, tree.commit, self.k) / label
        return [p for c in self.configs for p in [out / c] if p.is_dir()]


@dataclass
class Script(Item):
    """A lease script of its own, run while it exists; done once its record (`record`, a glob under lab/) is."""

    path: str = ""
    seconds: float = 560
    source: str = ""
    record: str = ""

    def state(self, tree, label):
        if not Path(self.path).is_file():
            return State(done=f"{self.path} is not written yet")
        if any(glob.glob(str(root / self.record)) for root in tree.lab) or self.marker.exists():
            return State(done="its record is committed")
        return State(seconds=self.seconds, source=self.source)

    def command(self, tree, label):
        return f"bash {self.path}"

    def recorded(self, rc, logs):
        return rc == 0


PAPER_H100 = ("fp16-best", "bf16-cl", "sdpa", "compile", "graphs", "opt1-ckpt", "best-ckpt")
ITEMS: list[Item] = [
    Roofs("roofs-h200", H200),
    Resume("resume-opt1", None, "opt1", 150, "leases.md 2026-12-07: about a minute for three 60-step runs at 32^3, "
           "one resumed process more, the pip install"),
    Resume("resume-best", None, "best", 420, "the H100: three compiled runs did not finish in 200 s; four processes "
           "compile, the first cold (about 120 s), the others from the FX cache (best's ablation warm-up: 39 s)"),
    Study("study-h100", H100, ("opt1", "bf16", "fp16", "best"), jobs=4),
    Study("study-h100-baseline", H100, ("baseline",), jobs=2),
    *[Counters(f"counters-{c}", H100, c) for c in ("baseline", "opt1", "opt2", "opt12", "bf16", "best")],
    *[Sweep(f"paper-{c}", H100, "paper", c, ref="best" if c == "fp16-best" else "",
            at_least=(400, "leases.md: best-ckpt, do not start with less than 400 s") if c == "best-ckpt" else (0, ""))
      for c in PAPER_H100],
    Ablation("ablation-h200", H200),
    Ablation("ablation-h100", H100),
    EndToEnd("end-to-end", None),
    *[Sweep(f"brats-{c}", H100, "brats", c, ref="best" if c == "best-ckpt" else "",
            at_least=(520, "leases.md: best-ckpt@brats compiles 188 s, samples first in 47 s, breaks down in about "
                           "180 s, then quality") if c == "best-ckpt" else (0, ""))
      for c in ("baseline", "opt1", "best", "best-ckpt")],
    *[Repeat(f"repeat{k}-{'h100' if card == H100 else 'h200'}", card, k) for card in CARDS for k in (1, 2, 3)],
    Script("levers", None, "lab/leases/2026-12-07-levers.sh", 560, "issue: one call measures best and every new "
           "variant", record="logs/*levers*"),
]


# ------------------------------------------------------------------------------------------------ the planner


def plan(tree: Tree, label: str, items: list[Item] | None = None) -> list[tuple[Item, State]]:
    """Every item with its state on the card `label`; one bound to another card is skipped with that reason."""
    rows = []
    for item in ITEMS if items is None else items:
        if item.card is not None and item.card != label:
            rows.append((item, State(done=f"on the {'H100' if item.card == H100 else 'H200'} only")))
            continue
        rows.append((item, item.state(tree, item.card or label)))
    return rows


def pick(rows: list[tuple[Item, State]], left: float, tried: set[str]) -> tuple[Item, State] | None:
    """The first owed item, in order, that fits the seconds left (a resumable one once it can start)."""
    for item, state in rows:
        if not state.done and item.name not in tried and (state.start_s or state.seconds) <= left:
            return item, state
    return None


def minutes(s: float) -> str:
    return f"{s / 60:.1f} min"


def show(rows: list[tuple[Item, State]], label: str) -> str:
    lines = [f"the queue on {label}:"]
    for i, (item, state) in enumerate(rows, 1):
        what = (f"skip: {state.done}" if state.done else
                f"owed {minutes(state.seconds)}" + (f" (starts with {minutes(state.start_s)})" if state.start_s else "")
                + f"  [{state.source}]")
        lines.append(f"{i:3d}. {item.name:<22}{' *' if item.card is None and not state.done else '  '} {what}")
    owed = sum(s.seconds for _, s in rows if not s.done)
    lines.append(f"owed on {label}: {minutes(owed)} in {sum(1 for _, s in rows if not s.done)} items (* either card: "
                 "owed once, on whichever comes first)")
    return "\n".join(lines)


def dry_run(tree: Tree, labels: list[str], limit: float) -> None:
    for label in labels:
        rows = plan(tree, label)
        print(show(rows, label))
        left, tried, calls = limit, set(), []
        while (chosen := pick(rows, left, tried)) is not None:
            item, state = chosen
            took = min(state.seconds, left - PACK_S) + PACK_S
            calls.append(f"{item.name} ({minutes(took)}{', part' if took < state.seconds + PACK_S else ''})")
            tried.add(item.name)
            left -= took
        print(f"a call of {minutes(limit)} on {label} would run: {', '.join(calls) or 'nothing'}; "
              f"{minutes(max(left, 0))} unused\n")


# ------------------------------------------------------------------------------------------------- the runner


def _pack(out: Path, finished: list[tuple[Item, list[Path], Path]]) -> str:
    """Pack the item just finished: its own tarball while there are slots, else into the last with those after it."""
    n = len(finished)
    group = finished[-1:] if n < TARBALLS else finished[TARBALLS - 1:]
    name = f"{n:02d}-{finished[-1][0].name}.tgz" if n < TARBALLS else f"{TARBALLS:02d}-more.tgz"
    tmp = out / f".{name}"
    with tarfile.open(tmp, "w:gz") as tar:
        for item, paths, logs in group:
            for p in paths:
                if p.exists():
                    rel = p.relative_to(WORK) if p.is_relative_to(WORK) else p
                    tar.add(p, arcname=str(rel), filter=lambda t: None if t.name.endswith(".ncu-rep") else t)
            tar.add(logs, arcname=f"lab/logs/queue/{item.name}",
                    filter=lambda t: None if Path(t.name).name in COPIES else t)
    tmp.rename(out / name)
    return name


def run(tree: Tree, label: str, limit: float, out: Path, items: list[Item] | None = None) -> list[str]:
    """Do the owed items that fit `limit` seconds, in order, each packed into `out` as it ends; returns the names of
    those that ran."""
    t0 = time.monotonic()
    finished: list[tuple[Item, list[Path], Path]] = []
    tried: list[str] = []
    did, short = [], []
    rows = plan(tree, label, items)
    print(show(rows, label), flush=True)
    while True:
        left = limit - (time.monotonic() - t0)
        chosen = pick(rows, left - PACK_S, set(tried))
        if chosen is None:
            break
        item, state = chosen
        tried.append(item.name)
        logs = WORK / "logs" / item.name
        logs.mkdir(parents=True, exist_ok=True)
        deadline = int(left - PACK_S)
        item_label = item.card or label
        # OUT too: a lease script packs into its OUT, and the call's $OUT holds only what the queue packs
        env = os.environ | {"DEADLINE": str(deadline), "ITEM_OUT": str(logs.absolute()), "OUT": str(logs.absolute()),
                            "LABEL": item_label}
        print(f"[{minutes(time.monotonic() - t0)}] {item.name}: start, {deadline} s given, "
              f"{minutes(state.seconds)} estimated", flush=True)
        t = time.monotonic()
        with open(logs / "item.log", "a") as log:
            rc = subprocess.run(["timeout", "-k", "10", str(deadline), "bash", "-c", item.command(tree, item_label)],
                                env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        took = time.monotonic() - t
        tail = (logs / "item.log").read_text(errors="replace").strip().splitlines()[-3:]
        if item.recorded(rc, logs):
            DONE.mkdir(parents=True, exist_ok=True)
            item.marker.touch()
        try:
            finished.append((item, item.packs(tree, item_label), logs))
            name = _pack(out, finished)
        except Exception as e:  # noqa: BLE001 - the next item still runs; the log says what was not packed
            name = f"nothing ({type(e).__name__}: {e})".splitlines()[0]
        print(f"[{minutes(time.monotonic() - t0)}] {item.name}: exit {rc} after {took:.0f} s, packed in {name}; "
              + " | ".join(line[-160:] for line in tail), flush=True)
        (did if rc == 0 else short).append(f"{item.name} ({took:.0f} s, exit {rc})")
        tree = Tree(tree.commit)  # what the item added counts now
        rows = plan(tree, label, items)
    if Path("runs/inductor").is_dir():  # the block sizes Triton tuned, for the next machine
        subprocess.run(["bash", "-c", f"source lab/leases/tools/inductor-cache.sh && autotune_out {shlex.quote(str(out))}"],
                       check=False)
    left = limit - (time.monotonic() - t0)
    print(f"did: {', '.join(did) or 'nothing'}")
    if short:
        print(f"ended short (its time ran out, or it failed; what it finished is packed): {', '.join(short)}")
    print("not owed here: " + "; ".join(f"{i.name} ({s.done})" for i, s in rows if s.done))
    owed = [(i, s) for i, s in rows if not s.done]
    print(f"left on {label}: {minutes(sum(s.seconds for _, s in owed))} ("
          + ", ".join(f"{i.name} {minutes(s.seconds)}" + ("" if i.name in tried else
                                                         f", needs {minutes(s.start_s or s.seconds)} to start")
                      for i, s in owed) + f"); {minutes(max(left, 0))} of this call unused")
    return tried


# ------------------------------------------------------------------------------------------------- self-check


@dataclass
class _Fake(Item):
    """An item that makes data/<label>/<name>/ in a fraction of a second, or claims to need `seconds`."""

    seconds: float = 1
    resumable: bool = False

    def state(self, tree, label):
        if (DATA_OUT / label / self.name).is_dir():
            return State(done="made")
        return State(seconds=self.seconds, source="made up", start_s=1 if self.resumable else 0)

    def command(self, tree, label):
        return f"sleep 0.2 && mkdir -p {DATA_OUT}/{label}/{self.name} && echo $DEADLINE > {DATA_OUT}/{label}/{self.name}/s"

    def packs(self, tree, label):
        return [DATA_OUT / label / self.name]


def self_check() -> None:
    """The runner on made-up items in a temporary folder: order, card, fit, packing in at most TARBALLS files."""
    import tempfile

    items = [_Fake("big", None, seconds=1000), _Fake("other-card", H100), *[_Fake(f"i{k}", None) for k in range(7)],
             _Fake("long-but-resumable", None, seconds=1000, resumable=True)]
    with tempfile.TemporaryDirectory() as tmp:
        here = os.getcwd()
        os.chdir(tmp)
        try:
            out = Path("out")
            out.mkdir()
            ran = run(Tree("abc1234"), H200, 120, out, items)
            want = [f"i{k}" for k in range(7)] + ["long-but-resumable"]
            assert ran == want, ran
            files = sorted(p.name for p in out.iterdir())
            assert files == [f"0{k + 1}-i{k}.tgz" for k in range(5)] + ["06-more.tgz"], files
            with tarfile.open(out / "06-more.tgz") as tar:
                held = {Path(n).parts[2] for n in tar.getnames() if n.startswith("data/")}
            assert held == {"i5", "i6", "long-but-resumable"}, held
            assert int((DATA_OUT / H200 / "i0" / "s").read_text()) <= 120 - PACK_S
            assert run(Tree("abc1234"), H200, 120, out, items) == [], "what is done is not done again"
            print("self-check: order, card, fit, packing and resume as intended")
        finally:
            os.chdir(here)


def card_here() -> str:
    if os.environ.get("CARD"):
        return os.environ["CARD"]
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return ""
    from medddpm.measure.env import gpu_slug

    return gpu_slug(name)


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "plan"
    commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip() or "unknown"
    tree = Tree(commit[:7])
    limit = float(os.environ.get("LIMIT", 560))
    label = card_here()
    if what == "self-check":
        self_check()
        return 0
    if what == "plan":
        dry_run(tree, [label] if label else list(CARDS), limit)
        return 0
    if what == "run":
        if not label:
            print("queue: no GPU here (nvidia-smi names none); DRY_RUN=1 lists the plan", file=sys.stderr)
            return 2
        out = Path(os.environ.get("OUT", "runs/out"))
        out.mkdir(parents=True, exist_ok=True)
        run(tree, label, limit, out)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
