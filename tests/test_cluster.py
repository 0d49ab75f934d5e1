"""The sweep's cluster backends (medddpm/cluster.py) and the container recipes (containers/)."""

import re
from pathlib import Path

import pytest

from medddpm.cli.main import main
from medddpm.measure.cluster import SlurmOptions, submit_slurm
from medddpm.configs import parse_config_list
from medddpm.store.schema import read_table

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.budget(200)  # 60-97 CPU seconds measured: two configurations, each a job of its own process
def test_the_slurm_backend_runs_each_configuration_as_a_job_through_submitit(tmp_path, monkeypatch):
    """The SLURM submission code, unchanged, on submitit's local executor (sbatch-only options ignored)."""
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    opts = SlurmOptions(partition="gpu", gpu_types=["h100"], time_min=20, folder=str(tmp_path / "jobs"))
    jobs = submit_slurm(parse_config_list("baseline,opt2"), preset="smoke", out=str(tmp_path / "data"), opts=opts,
                        params={"phases": "", "micro_steps": 1, "warmup": 1, "sample_steps": 2}, device="cpu", cluster="local")
    assert len(jobs) == 2, "one job per (GPU type, configuration)"
    for job, name in zip(jobs, ("baseline", "opt2")):
        (result,) = job.result()  # re-raises a failure inside the job, with its traceback
        assert result["config"] == name and result["status"] == "ok", (result, job.stderr())
        (folder,) = (tmp_path / "data" / "cpu").glob(f"{name}~*")  # steps of its own: beside the preset's
        run = read_table(folder / "run.parquet")
        assert run.loc[0, "status"] == "ok" and run.loc[0, "config"] == name and run.loc[0, "gpu_slug"] == "cpu"
        assert (folder / "produce.ipynb").exists()
    assert not list((tmp_path / "data" / "cpu").glob(".*")), "no staging folders left behind"


def test_slurm_dry_run_prints_one_sbatch_script_per_configuration(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "--backend", "slurm", "--dry-run", "--configs", "baseline,opt1", "--preset", "paper",
                 "--partition", "gpu-long", "--gpu-type", "h100", "--time-min", "90", "--phases", "torch",
                 "--out", str(tmp_path / "data"), "--slurm-folder", str(tmp_path / "jobs")]) == 0
    out, err = capsys.readouterr()
    assert not err, err
    scripts = re.split(r"\n(?=#!/bin/bash\n)", out.strip())
    assert len(scripts) == 2
    for script, name in zip(scripts, ("baseline", "opt1")):
        lines = script.splitlines()
        assert lines[0] == "#!/bin/bash"
        assert "#SBATCH --gres=gpu:h100:1" in lines
        assert "#SBATCH --time=90" in lines and "#SBATCH --partition=gpu-long" in lines
        assert f"#SBATCH --job-name=medddpm-h100-{name}" in lines
        assert f"# medddpm: python -m medddpm sweep --configs {name} --preset paper --out {tmp_path / 'data'}" \
               f" --phases torch" in lines
        assert any(line.startswith("export PYTHONPATH=") and str(ROOT) in line for line in lines)
        assert re.search(r"^srun .* -m submitit\.core\._submit ", script, re.M), "the job runs the pickled sweep"
    # Without a GPU type: any GPU.
    assert main(["sweep", "--backend", "slurm", "--dry-run", "--configs", "opt12", "--out", str(tmp_path / "data")]) == 0
    out, err = capsys.readouterr()
    assert "#SBATCH --gpus-per-node=1" in out.splitlines(), err
    assert not (tmp_path / "data").exists() and not (tmp_path / "jobs").exists(), "a dry run writes nothing"


def test_dry_run_without_the_slurm_backend_is_refused(tmp_path, capsys):
    assert main(["sweep", "--dry-run", "--out", str(tmp_path / "d")]) == 2
    assert "--backend slurm" in capsys.readouterr().err


def _docker_steps(text: str) -> dict:
    lines = [ln for ln in text.replace("\\\n", " ").splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return {"from": [ln.split()[1] for ln in lines if ln.startswith("FROM ")],
            "copy": [ln.split()[1:] for ln in lines if ln.startswith("COPY ")],
            "run": " ".join(ln for ln in lines if ln.startswith("RUN ")),
            "env": " ".join(ln for ln in lines if ln.startswith("ENV ")),
            "cmd": [ln for ln in lines if ln.startswith("CMD ")]}


def _def_sections(text: str) -> dict:
    sections, name = {"header": []}, "header"
    for line in text.splitlines():
        if line.startswith("%"):
            name = line.split()[0][1:]
            sections[name] = []
        elif line.strip() and not line.lstrip().startswith("#"):
            sections[name].append(line.strip())
    return sections


INSTALL = re.compile(r"pip install -c \S+ -r \S*requirements\S*\.txt")


def test_the_container_recipes_install_the_pinned_requirements_and_the_package():
    docker = _docker_steps((ROOT / "containers" / "Dockerfile").read_text())
    apptainer = _def_sections((ROOT / "containers" / "medddpm.def").read_text())
    header = dict(ln.split(":", 1) for ln in apptainer["header"])
    (base,) = docker["from"]
    assert re.fullmatch(r"(nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3|pytorch/pytorch:[\d.]+-cuda12\.\d+-cudnn9-\w+)", base)
    assert header["Bootstrap"].strip() == "docker" and header["From"].strip() == base, "same base image"

    # requirements.txt copied, installed without its torch line, against the image's torch.
    assert ["requirements.txt", "/opt/medddpm/requirements.txt"] in docker["copy"]
    assert "requirements.txt /opt/medddpm/requirements.txt" in apptainer["files"]
    for run in (docker["run"], " ".join(apptainer["post"])):
        assert INSTALL.search(run)
        assert re.search(r"grep -v -E '\^torch", run) and "torch.__version__" in run
    # The pattern drops exactly the torch pin.
    pattern = re.search(r"grep -v -E '([^']+)'", docker["run"]).group(1)
    kept = [ln for ln in (ROOT / "requirements.txt").read_text().splitlines() if not re.search(pattern, ln)]
    assert not any(ln.startswith("torch==") for ln in kept)
    assert "submitit==" in " ".join(kept) and "papermill==" in " ".join(kept) and "torchx" not in " ".join(kept)
    assert len(kept) == len((ROOT / "requirements.txt").read_text().splitlines()) - 1

    # The package and its notebook, importable from anywhere.
    for src in ("medddpm", "notebooks"):
        assert [src, f"/opt/medddpm/{src}"] in docker["copy"]
        assert f"{src} /opt/medddpm/{src}" in apptainer["files"]
    assert "PYTHONPATH=/opt/medddpm" in docker["env"]
    assert any(ln.startswith("export PYTHONPATH=/opt/medddpm") for ln in apptainer["environment"])

    # The default command: every configuration at the paper's size, into the mounted /work/data.
    sweep = "python -m medddpm sweep --preset paper --configs all --out /work/data"
    assert docker["cmd"] == ['CMD ["' + '", "'.join(sweep.split()) + '"]']
    assert any(sweep in ln for ln in apptainer["runscript"])


@pytest.mark.parametrize("line", ["torch==2.13.0", "torch>=2", "torch ; sys_platform == 'linux'", "torch"])
def test_the_torch_filter_matches_torch_only(line):
    pattern = re.search(r"grep -v -E '([^']+)'", (ROOT / "containers" / "Dockerfile").read_text()).group(1)
    assert re.search(pattern, line)
    for other in ("torchvision==0.1", "torchx==1", "numpy==2"):
        assert not re.search(pattern, other)
