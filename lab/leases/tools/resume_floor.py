"""Kill-and-resume judged against the floor two uninterrupted runs set (lab/leases/2026-12-07-resume-floor.sh).

On a GPU two uninterrupted runs of one training command differ (cuDNN's algorithm choice and atomics are not
deterministic), so a resumed run cannot be held to bit-exactness there. Three runs of one command, a and b
uninterrupted and `cut` killed after its first checkpoint and resumed, give three distances, group by group of the
final checkpoint (model, ema, opt, cpu_rng, cuda_rng) and of the loss log: a-b is the floor, a-cut and b-cut the
resume's. The resume passes where, in every group, both of its distances are at most FACTOR times the floor; where
the floor is zero (the CPU, and on a GPU the RNG states and Adam's step counts, which no kernel touches) the rule is
bit-exactness.

FACTOR = 10. The three runs are of equal standing when the resume is right: the resumed run is one more draw of
the same nondeterminism (its second process also picks its cuDNN algorithms again), so its distances and the floor
come from one distribution, and the judge only fails a right resume where the floor is an unusually small draw of
it. On the H100 (opt1, 32^3, 60 steps, killed after step 10) the resumed distances were 1.01x (weights), 2.1x (Adam's
state) and 2.0x (loss log) the floor; 10 leaves five times that. A resume bug moves a run by orders of magnitude
more: a lost RNG state draws other noise and timesteps (the loss of a step differs by about 1e-1 against a floor of
1e-7, the weights by about lr per step), a lost optimizer state restarts Adam (moments of the gradient's size against
a floor of 6e-6, and its step counts, equal in every right run, differ by the steps before the kill), a replayed step
adds one Adam step (the step counts differ by 1, the weights by about lr = 1e-5 against 10 x 5.7e-7). `bug` shows
each of these on the CPU.

    python3 lab/leases/tools/resume_floor.py record OUT.json CONFIG [--root runs/resume] [--cut cut]
    python3 lab/leases/tools/resume_floor.py judge RECORD.json [...] [--factor 10]     (exit 1 where one fails)
    python3 lab/leases/tools/resume_floor.py bug {rng,opt,replay} --root runs/resume/opt1 --out OUT.json
    python3 lab/leases/tools/resume_floor.py self-check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

FACTOR = 10.0
PAIRS = ("a-b", "a-cut", "b-cut")  # the floor, then the resume's two distances
LOGS = Path("runs/resume-logs")


# ------------------------------------------------------------------------------------------------- the record


def _tensors(x, prefix=""):
    import torch

    if isinstance(x, torch.Tensor):
        yield prefix, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _tensors(v, f"{prefix}/{i}")


def _diff(x, y) -> float:
    import torch

    if x.shape != y.shape:
        return math.inf
    if not x.is_floating_point():
        return 0.0 if torch.equal(x, y) else math.inf
    return float((x.double() - y.double()).abs().max()) if x.numel() else 0.0


def record(config: str, root: Path, cut: str = "cut", killed: str = "") -> dict:
    """The distances between the final checkpoints and loss logs of runs a, b and `cut` under root/<config>/."""
    import torch

    from medddpm.train.loop import read_loss_log

    folder = root / config
    rec = {"config": config, "cut": cut,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        runs = {"a": "a", "b": "b", "cut": cut}
        states = {r: torch.load(folder / d / "checkpoint.pt", weights_only=True, map_location="cpu")
                  for r, d in runs.items()}
        flat = {r: dict(_tensors(s)) for r, s in states.items()}
        losses = {r: [float(x["loss"]) for x in read_loss_log(folder / d)] for r, d in runs.items()}
        rec |= {"steps": {r: int(s["step"]) for r, s in states.items()},
                "killed_after_step": killed or (LOGS / f"{config}-killed-at.txt").read_text().strip(),
                "tensors": len(flat["a"]), "losses": losses, "pairs": {}}
        for pair in PAIRS:
            p, q = pair.split("-")
            keys = sorted(set(flat[p]) | set(flat[q]))
            per = {k: (_diff(flat[p][k], flat[q][k]) if k in flat[p] and k in flat[q] else math.inf) for k in keys}
            groups = {}
            for k, v in per.items():
                g = k.split("/")[1]
                groups[g] = max(groups.get(g, 0.0), v)
            lp, lq = losses[p], losses[q]
            groups["loss_log"] = max(abs(u - v) for u, v in zip(lp, lq)) if len(lp) == len(lq) and lp else math.inf
            rec["pairs"][pair] = {"groups": groups, "tensors_equal": sum(v == 0 for v in per.values()),
                                  "per_tensor": per}
    except Exception as e:  # noqa: BLE001 - recorded; the next configuration still runs
        rec["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
    return rec


# -------------------------------------------------------------------------------------------------- the judge


def from_summary(summary: dict) -> dict:
    """A record from a hand summary that keeps the floor and one resumed distance per group (the H100's
    resume-floor.json of 2026-12-07): pairs a-b and a-cut only."""
    return {"config": summary["config"], "device": summary.get("card", ""), "killed_after_step": summary["killed_at"],
            "steps": {"a": summary["steps"], "b": summary["steps"], "cut": summary["steps"]},
            "pairs": {"a-b": {"groups": summary["max_abs_diff_two_uninterrupted_runs"]},
                      "a-cut": {"groups": summary["max_abs_diff_uninterrupted_vs_resumed"]}}}


def judge(rec: dict, factor: float = FACTOR) -> dict:
    """{verdict: pass | fail, why, groups: {group: {floor, resumed, limit, ratio, ok}}} of one configuration's record."""
    if "error" in rec:
        return {"verdict": "fail", "why": f"no record: {rec['error']}", "groups": {}}
    steps = set(rec["steps"].values())
    killed = int(str(rec["killed_after_step"]).split()[-1])
    if len(steps) != 1:
        return {"verdict": "fail", "why": f"the runs ended at different steps {rec['steps']}", "groups": {}}
    if not 0 < killed < steps.pop():
        return {"verdict": "fail", "why": f"the cut run was not cut (killed after step {killed})", "groups": {}}
    floor = rec["pairs"]["a-b"]["groups"]
    resumed = [rec["pairs"][p]["groups"] for p in PAIRS[1:] if p in rec["pairs"]]
    groups = {}
    for g in sorted(set(floor).union(*resumed)):
        f = floor.get(g, math.inf)
        d = max(r.get(g, math.inf) for r in resumed)
        limit = factor * f
        groups[g] = {"floor": f, "resumed": d, "limit": limit, "ratio": d / f if f else (0.0 if d == 0 else math.inf),
                     "ok": math.isfinite(f) and d <= limit}
    bad = [g for g, v in groups.items() if not v["ok"]]
    why = ("every group within the factor" if not bad else
           "; ".join(f"{g}: {groups[g]['resumed']:.3g} against a floor of {groups[g]['floor']:.3g}" for g in bad))
    return {"verdict": "pass" if not bad else "fail", "why": why, "groups": groups}


def _load(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        return [from_summary(data)]
    return data


def _show(rec: dict, verdict: dict, factor: float) -> str:
    lines = [f"{rec['config']} on {rec.get('device', '?')} (cut {rec.get('cut', 'cut')}, killed after step "
             f"{rec.get('killed_after_step', '?')}): {verdict['verdict']} at {factor:g}x the floor: {verdict['why']}"]
    for g, v in verdict["groups"].items():
        lines.append(f"  {g:<9} floor {v['floor']:9.3g}  resumed {v['resumed']:9.3g}  ratio {v['ratio']:8.3g}  "
                     f"{'ok' if v['ok'] else 'OVER'}")
    if "a-cut" in rec["pairs"] and "per_tensor" in rec["pairs"]["a-b"]:
        exact = {k for k, v in rec["pairs"]["a-b"]["per_tensor"].items() if v == 0}
        moved = sorted(k for p in PAIRS[1:] for k, v in rec["pairs"][p]["per_tensor"].items() if k in exact and v)
        lines.append(f"  tensors equal in a and b: {len(exact)} of {rec['tensors']}; of those, differing after the "
                     f"resume: {len(set(moved))}" + (f" (first {moved[0]})" if moved else ""))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- the bugs, on a CPU


def _train_args(config: str, out: Path, steps: int, save_every: int, device: str) -> list[str]:
    """The lease's `train` command (2026-12-07-resume-floor.sh), for a run of `steps` steps into `out`."""
    return ["train", "--config", config, "--out", str(out), "--size", "32", "--mask-channels", "3", "--pairs", "4",
            "--grad-accum", "2", "--steps", str(steps), "--save-every", str(save_every), "--log-every", "1",
            "--device", device]


def _resume_with_bug(kind: str, argv: list[str]) -> int:
    """`python -m medddpm train` in this process, its checkpoint loaded with one bug."""
    from collections import defaultdict

    import torch

    from medddpm.cli.main import main
    from medddpm.train.engine import Engine

    load = Engine.load_state_dict

    def buggy(self, state):
        rng = torch.get_rng_state()
        load(self, state)
        if kind == "rng":  # the RNG states are not restored: the process's own seeding stays
            torch.set_rng_state(rng)
        elif kind == "opt":  # Adam's moments and step counts are lost: it starts again
            self.opt.state = defaultdict(dict)
        elif kind == "replay":  # the checkpoint's step is taken as one earlier: that step runs twice
            self.step_count -= 1

    Engine.load_state_dict = buggy
    return main(argv)


def bug(kind: str, root: Path, device: str = "cpu") -> dict:
    """Resume a copy of root's cut run from its kill point with one bug, and record it against a and b."""
    import torch

    config = root.name

    steps = int(torch.load(root / "a" / "checkpoint.pt", weights_only=True)["step"])
    killed = int((LOGS / f"{config}-killed-at.txt").read_text().split()[-1])
    prefix = root / f"cut-at-{killed}"
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    if not (prefix / "checkpoint.pt").is_file():  # the run up to its first checkpoint, as the killed one left it
        subprocess.run([sys.executable, "-m", "medddpm", *_train_args(config, prefix, killed, killed, device)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
    run = root / f"cut-{kind}"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(prefix, run)
    subprocess.run([sys.executable, __file__, "resume-with-bug", kind, "--",
                    *_train_args(config, run, steps, killed, device)], check=True, env=env, stdout=subprocess.DEVNULL)
    return record(config, root.parent, cut=run.name, killed=str(killed)) | {"bug": kind}


# ------------------------------------------------------------------------------------------------- self-check


def self_check() -> None:
    """The rule on made-up records: both outcomes of each of its branches."""
    def rec(floor: dict, resumed: dict, killed=10, steps=60) -> dict:
        return {"config": "x", "steps": {"a": steps, "b": steps, "cut": steps}, "killed_after_step": killed,
                "pairs": {"a-b": {"groups": floor}, "a-cut": {"groups": resumed}, "b-cut": {"groups": resumed}}}

    h100 = {"model": 5.718e-07, "ema": 5.718e-07, "opt": 6.117e-06, "loss_log": 1.19e-07, "cpu_rng": 0.0}
    cases = [
        ("the H100's resume (up to 2.1x)", rec(h100, {"model": 5.793e-07, "ema": 5.793e-07, "opt": 1.302e-05,
                                                       "loss_log": 2.38e-07, "cpu_rng": 0.0}), "pass"),
        ("just inside the factor", rec(h100, {k: v * 9.99 for k, v in h100.items()}), "pass"),
        ("just outside it", rec(h100, {k: v * 10.01 for k, v in h100.items()}), "fail"),
        ("a zero floor, equal", rec({"model": 0.0}, {"model": 0.0}), "pass"),
        ("a zero floor, 1e-12 apart", rec({"model": 0.0}, {"model": 1e-12}), "fail"),
        ("a group only the resume has", rec({"model": 1e-6}, {"model": 1e-6, "cuda_rng": 0.0}), "fail"),
        ("a cut run that was not cut", rec(h100, h100, killed=60), "fail"),
        ("a lost RNG state (loss 0.05 apart)", rec(h100, h100 | {"loss_log": 0.05}), "fail"),
        ("a replayed step (Adam's step counts 1 apart)", rec(h100, h100 | {"opt": 1.0}), "fail"),
    ]
    for name, r, want in cases:
        got = judge(r)["verdict"]
        assert got == want, f"{name}: {got}, expected {want}"
        print(f"self-check: {name}: {got}")


# ---------------------------------------------------------------------------------------------------- command


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["resume-with-bug"]:
        return _resume_with_bug(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    parser = argparse.ArgumentParser(prog="resume_floor.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("record", help="the distances of runs a, b and cut under ROOT/CONFIG/, as JSON")
    p.add_argument("out")
    p.add_argument("config")
    p.add_argument("--root", default="runs/resume")
    p.add_argument("--cut", default="cut")
    p = sub.add_parser("judge", help="the verdict of each record: exit 1 where one fails")
    p.add_argument("records", nargs="+")
    p.add_argument("--factor", type=float, default=FACTOR)
    p = sub.add_parser("bug", help="a resume with one bug, on a CPU, recorded against the lease's a and b")
    p.add_argument("kind", choices=("rng", "opt", "replay"))
    p.add_argument("--root", required=True, help="the lease's runs/resume/<config>")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu")
    sub.add_parser("self-check", help="the rule on made-up records, both outcomes")
    args = parser.parse_args(argv)
    if args.command == "record":
        rec = record(args.config, Path(args.root), cut=args.cut)
        Path(args.out).write_text(json.dumps([rec], indent=1) + "\n")
        print(json.dumps({k: v for k, v in rec.items() if k not in ("pairs", "losses")}),
              {p: v["groups"] for p, v in rec.get("pairs", {}).items()})
        return 0
    if args.command == "bug":
        rec = bug(args.kind, Path(args.root), args.device)
        Path(args.out).write_text(json.dumps([rec], indent=1) + "\n")
        print(_show(rec, judge(rec), FACTOR))
        return 0
    if args.command == "self-check":
        self_check()
        return 0
    failed = False
    for path in args.records:
        for rec in _load(Path(path)):
            verdict = judge(rec, args.factor)
            failed |= verdict["verdict"] != "pass"
            print(_show(rec, verdict, args.factor))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
