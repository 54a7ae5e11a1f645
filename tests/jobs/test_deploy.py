"""The deploy/ recipes do what they promise.

* deploy/torchrun/launch.sh runs examples/train_ddp.py under torchrun; a
  worker SIGKILLed mid-run makes torchrun restart the group, which resumes from
  the newest committed step and ends bitwise equal to an uninterrupted run;
  SIGTERM to the launcher reaches every worker and the job saves and exits.
* The Kubernetes manifests, the compose file and the systemd unit are parsed
  and checked field by field (the wiring between uploader and trainer, the
  grace-period arithmetic, credentials from Secrets); the pod's and the compose
  trainer's own settings are then run for real against a local S3 server.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
import yaml
from helpers import ROOT, child_env, descendants, free_port, kill_job, wait_for
from s3server import S3Server, stop_uploaders

DEPLOY = ROOT / "deploy"
LAUNCH = DEPLOY / "torchrun" / "launch.sh"
EXAMPLE = ROOT / "examples" / "train_ddp.py"


def step_manifest(step: int) -> str:
    """Where a committed step's manifest sits, relative to its tier's root."""
    return f"step_{step:010d}/shardckpt.json"


# --------------------------------------------------------------- the launch script


def launch_env(ckpt_dir: Path, **extra: str) -> dict[str, str]:
    return child_env(PYTHON=sys.executable, NPROC_PER_NODE="2", CKPT_DIR=str(ckpt_dir), **extra)


def start_launch(log: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    """launch.sh in its own session (so the whole job can be killed), output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen([str(LAUNCH), *map(str, args)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=str(ROOT), start_new_session=True)


def proc_stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def worker_pid(launcher: int, rank: int) -> int:
    """The worker of ``rank`` that torchrun (the launcher, after exec) started, found by its environment."""
    for pid in descendants(launcher):
        try:
            if int(proc_stat(pid)[1]) != launcher:
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} under pid {launcher}")


def exited(pid: int) -> bool:
    try:
        return proc_stat(pid)[0] in ("Z", "X")
    except OSError:
        return True


def dry_run(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LAUNCH), "train.py", "--lr", "1"], env={**child_env(DRY_RUN="1"), **env},
                          capture_output=True, text=True, timeout=30)


def test_launch_script_builds_torchrun_commands_and_documents_its_variables():
    text = LAUNCH.read_text()
    help_text = subprocess.run([str(LAUNCH), "--help"], capture_output=True, text=True, timeout=30, check=True).stdout
    for name in set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", text)):
        assert name in help_text, f"launch.sh reads ${name} but --help does not mention it"
    assert text.rstrip().splitlines()[-1].startswith('exec "$PYTHON" -m torch.distributed.run')

    single = dry_run().stdout
    assert "--standalone" in single and "--nproc-per-node=1" in single and single.rstrip().endswith("train.py --lr 1")
    multi = dry_run(NNODES="2:4", NPROC_PER_NODE="8", RDZV_ENDPOINT="node0:29400", RDZV_ID="run1").stdout
    for flag in ("--nnodes=2:4", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400",
                 "--rdzv-id=run1", "--max-restarts=3"):
        assert flag in multi
    # The Kubeflow operator's MASTER_ADDR / MASTER_PORT serve as the endpoint.
    operator = dry_run(NNODES="2", MASTER_ADDR="train-run1-master-0", MASTER_PORT="29400").stdout
    assert "--rdzv-endpoint=train-run1-master-0:29400" in operator

    missing = dry_run(NNODES="2")
    assert missing.returncode == 2 and "RDZV_ENDPOINT" in missing.stderr
    bad = dry_run(NNODES="two")
    assert bad.returncode == 2 and "NNODES" in bad.stderr


def test_killed_worker_restarts_the_group_and_ends_bitwise_equal(tmp_path):
    """SIGKILL one worker after step 10 committed: torchrun restarts, the job resumes, same weights."""
    args = (EXAMPLE, "--steps", 40, "--every", 5, "--step-sleep", 0.1)
    ref_env = launch_env(tmp_path / "ref" / "ckpt")
    env = launch_env(tmp_path / "job" / "ckpt", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", MAX_RESTARTS="1")
    ref_log, log = tmp_path / "ref.log", tmp_path / "job.log"
    reference = start_launch(ref_log, ref_env, *args)
    job = start_launch(log, env, *args)
    try:
        wait_for(lambda: "torch.distributed.run" in Path(f"/proc/{job.pid}/cmdline").read_text(), 10,
                 "launch.sh to exec torchrun", proc=job, log_path=log)
        wait_for(lambda: (tmp_path / "job" / "ckpt" / step_manifest(10)).exists(), 180, "step 10 to commit",
                 proc=job, log_path=log)
        survivor = worker_pid(job.pid, rank=0)
        os.kill(worker_pid(job.pid, rank=1), signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: exited(survivor), 60, "the surviving worker to exit", proc=job, log_path=log)
        survivor_s = time.monotonic() - killed_at
        wait_for(lambda: "resuming from step" in log.read_text(), 120, "the restarted group to resume",
                 proc=job, log_path=log)
        restart_s = time.monotonic() - killed_at
        assert job.wait(timeout=180) == 0, log.read_text()[-4000:]
        assert reference.wait(timeout=180) == 0, ref_log.read_text()[-4000:]
    finally:
        for proc in (job, reference):
            if proc.poll() is None:
                kill_job(proc)

    text = log.read_text()
    resumed = int(re.search(r"resuming from step (\d+)", text).group(1))
    assert 10 <= resumed < 40, f"resumed from step {resumed}: the kill did not land mid-run"
    assert text.count("[train_ddp] starting fresh") == 1 and "finished 40 steps" in text
    # torchrun SIGTERMs the surviving worker and SIGKILLs it only 30 s later, saying so: the survivor
    # must leave by itself before that (its collective fails when the peer is gone).
    assert "failed (exitcode: -9)" in text  # torchrun's own log is in this one (the killed worker)
    assert "Unable to shutdown process" not in text, text[-4000:]
    print(f"after the kill: survivor gone in {survivor_s:.1f} s, group resumed in {restart_s:.1f} s")
    expected = torch.load(tmp_path / "ref" / "final.pt")
    actual = torch.load(tmp_path / "job" / "final.pt")
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


def test_sigterm_to_the_launcher_saves_once_more_and_exits(tmp_path):
    """What a spot reclaim or `kubectl delete` does: SIGTERM to launch.sh's pid."""
    log = tmp_path / "job.log"
    job = start_launch(log, launch_env(tmp_path / "ckpt"), EXAMPLE, "--steps", 100000, "--every", 1000,
                       "--step-sleep", 0.05)
    try:
        wait_for(lambda: "step    5" in log.read_text(), 180, "five training steps", proc=job, log_path=log)
        os.kill(job.pid, signal.SIGTERM)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            kill_job(job)
    found = re.search(r"preempted: step (\d+) is committed", log.read_text())
    assert found, log.read_text()[-4000:]
    step = int(found.group(1))
    assert step >= 5 and step % 1000, "the save came from the signal, not the interval"
    assert (tmp_path / "ckpt" / step_manifest(step)).exists()


# --------------------------------------------------------------- Kubernetes

SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD", re.I)


def k8s_docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]


def k8s_pods() -> dict[str, tuple[dict, dict]]:
    """(owning object, pod spec) for every pod template of the k8s recipes."""
    pods = {}
    for doc in k8s_docs("indexed-job.yaml"):
        if doc["kind"] == "Job":
            pods["indexed-job"] = (doc, doc["spec"]["template"]["spec"])
    for doc in k8s_docs("pytorchjob.yaml"):
        if doc["kind"] == "PyTorchJob":
            for role, replica in doc["spec"]["pytorchReplicaSpecs"].items():
                pods[f"pytorchjob-{role}"] = (doc, replica["template"]["spec"])
    return pods


PODS = k8s_pods()


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container: dict, name: str) -> str:
    return env_of(container)[name]["value"]


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def sidecar_and_trainer(pod: dict) -> tuple[dict, dict]:
    sidecars = [c for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    assert len(sidecars) == 1, "the uploader must be the one native sidecar (an initContainer, restartPolicy Always)"
    trainers = [c for c in pod["containers"] if "launch.sh" in " ".join(c.get("command", []) + c.get("args", []))]
    assert len(trainers) == 1
    return sidecars[0], trainers[0]


def mount_of(container: dict, path: str) -> dict:
    """The volume mount that holds ``path`` in ``container``."""
    mounts = [m for m in container["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")]
    assert mounts, f"{path} is on no volume of {container['name']}"
    return mounts[0]


@pytest.mark.parametrize("name", sorted(PODS))
def test_k8s_sidecar_and_trainer_share_checkpoints_remote_and_credentials(name):
    _, pod = PODS[name]
    sidecar, trainer = sidecar_and_trainer(pod)
    argv = sidecar["command"] + sidecar.get("args", [])
    assert argv[:2] == ["shardckpt", "sync"], argv
    local, remote = option(argv, "--local"), option(argv, "--remote")

    assert env_value(trainer, "SHARDCKPT_LOCAL_DIR") == local
    assert env_value(trainer, "SHARDCKPT_REMOTE") == remote
    assert env_value(trainer, "SHARDCKPT_UPLOADER") == "external"  # no second uploader in the trainer
    assert env_value(trainer, "AWS_ENDPOINT_URL") == env_value(sidecar, "AWS_ENDPOINT_URL")

    sidecar_mount, trainer_mount = mount_of(sidecar, local), mount_of(trainer, local)
    assert sidecar_mount == trainer_mount, "the same volume at the same path in both containers"
    volume = next(v for v in pod["volumes"] if v["name"] == sidecar_mount["name"])
    assert "hostPath" in volume or "ephemeral" in volume, f"checkpoint volume {volume} is not node-local"
    # Without it the trainer cannot see the sidecar's pid and close() stops waiting for uploads.
    assert pod.get("shareProcessNamespace") is True

    for container in (sidecar, trainer):
        for var_name, var in env_of(container).items():
            if SECRET_NAME.search(var_name):
                assert "value" not in var and "secretKeyRef" in var.get("valueFrom", {}), (container["name"], var_name)


@pytest.mark.parametrize("name", sorted(PODS))
def test_k8s_trainer_execs_torchrun_from_the_image(name):
    _, pod = PODS[name]
    _, trainer = sidecar_and_trainer(pod)
    dockerfile = (DEPLOY / "compose" / "Dockerfile").read_text()
    assert f"WORKDIR {trainer['workingDir']}" in dockerfile
    argv = trainer["command"]
    assert argv[0] == "deploy/torchrun/launch.sh" and (ROOT / argv[1]).is_file()
    assert "COPY deploy/torchrun deploy/torchrun" in dockerfile and "COPY examples examples" in dockerfile
    # launch.sh ends in exec: torchrun becomes the container's main process and gets SIGTERM.
    assert LAUNCH.read_text().rstrip().splitlines()[-1].startswith("exec ")


@pytest.mark.parametrize("name", sorted(PODS))
def test_k8s_grace_period_covers_the_emergency_save_and_upload(name):
    owner, pod = PODS[name]
    _, trainer = sidecar_and_trainer(pod)
    ann = owner["metadata"]["annotations"]
    size, save_rate, upload_rate, step_s, margin = (
        float(ann[f"shardckpt/grace-{k}"])
        for k in ("state-gb-per-node", "save-gb-per-s", "upload-gb-per-s", "step-s", "margin-s")
    )
    to_commit = 2 * step_s + 2 * size / save_rate  # signal acted on 2 steps later; a save in flight + the emergency one
    upload = 2 * size / upload_rate  # that step's upload and the emergency step's
    grace = pod["terminationGracePeriodSeconds"]
    shutdown = int(env_value(trainer, "SHUTDOWN_TIMEOUT"))
    drain = float(env_value(trainer, "SHARDCKPT_DRAIN_TIMEOUT_S"))
    assert grace >= to_commit + upload + margin
    assert to_commit + upload <= shutdown < grace, "torchrun must not SIGKILL workers that save, nor outlive the pod"
    assert drain >= upload and to_commit + drain <= shutdown, "close() waits for the upload and returns in time"


def test_indexed_job_runs_one_pod_per_node_with_a_rendezvous_service():
    docs = {d["kind"]: d for d in k8s_docs("indexed-job.yaml")}
    job, service = docs["Job"], docs["Service"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    _, trainer = sidecar_and_trainer(pod)
    nnodes = int(env_value(trainer, "NNODES"))
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == nnodes
    assert pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]

    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    host, port = env_value(trainer, "RDZV_ENDPOINT").rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"  # pod 0's DNS name
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert int(port) in [p["containerPort"] for p in trainer["ports"]]

    assert pod["restartPolicy"] == "Never"
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "type": "DisruptionTarget"} in [
        {"action": r["action"], "type": c["type"]} for r in rules for c in r.get("onPodConditions", [])
    ], "a preempted pod must not count as a failure"


def test_pytorchjob_replicas_match_nnodes_and_the_operator_endpoint():
    job = next(d for d in k8s_docs("pytorchjob.yaml") if d["kind"] == "PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    for role, replica in replicas.items():
        _, trainer = sidecar_and_trainer(replica["template"]["spec"])
        assert int(env_value(trainer, "NNODES")) == sum(r["replicas"] for r in replicas.values()), role
        # The operator sets MASTER_ADDR/MASTER_PORT in the container named pytorch from this port;
        # launch.sh turns them into the rendezvous endpoint.
        assert trainer["name"] == "pytorch"
        assert [p["name"] for p in trainer["ports"]] == ["pytorchjob-port"]
        assert "RDZV_ENDPOINT" not in env_of(trainer)


def test_k8s_recipes_run_the_same_pod():
    """The PyTorchJob repeats the Indexed Job's pod; only what the operator dictates differs."""
    (job, job_pod), (pytorchjob, master_pod) = PODS["indexed-job"], PODS["pytorchjob-Master"]
    assert job["metadata"]["annotations"] == pytorchjob["metadata"]["annotations"]  # the grace-period inputs
    job_sidecar, job_trainer = sidecar_and_trainer(job_pod)
    master_sidecar, master_trainer = sidecar_and_trainer(master_pod)
    assert job_sidecar == master_sidecar
    assert job_pod["volumes"] == master_pod["volumes"]
    for key in ("serviceAccountName", "shareProcessNamespace", "terminationGracePeriodSeconds"):
        assert job_pod[key] == master_pod[key], key
    operator_set = {"name", "ports", "env"}
    assert {k: v for k, v in job_trainer.items() if k not in operator_set} == {
        k: v for k, v in master_trainer.items() if k not in operator_set}
    assert {k: v for k, v in env_of(job_trainer).items() if k != "RDZV_ENDPOINT"} == env_of(master_trainer)


def test_k8s_pod_trainer_waits_for_its_sidecar_to_upload(tmp_path):
    """The indexed Job's pod, run here: the sidecar's command and the trainer's environment.

    Node-specific values are swapped for local ones (the volume becomes a
    directory, the endpoint a local S3 server, 1 node of 2 workers, 10 steps);
    the rest, uploader mode and drain timeout included, comes from the manifest.
    When the trainer exits, its last step must already be committed remotely.
    """
    _, pod = PODS["indexed-job"]
    sidecar, trainer = sidecar_and_trainer(pod)
    mount = mount_of(trainer, env_value(trainer, "SHARDCKPT_LOCAL_DIR"))["mountPath"]

    def local(value: str) -> str:
        return value.replace(mount, str(tmp_path / "volume"), 1) if value.startswith(mount) else value

    s3 = S3Server()
    sidecar_proc = None
    try:
        remote = urlparse(env_value(trainer, "SHARDCKPT_REMOTE"))
        s3.client().create_bucket(Bucket=remote.netloc)
        env = {name: local(var["value"]) for name, var in env_of(trainer).items() if "value" in var}
        env.update(s3.env(), NNODES="1", NPROC_PER_NODE="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}")
        argv = [local(a) for a in sidecar["command"]]
        sidecar_proc = subprocess.Popen([sys.executable, "-m", "shardckpt.cli", *argv[1:]], env=child_env(**s3.env()),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        script = trainer["command"][1]
        job = subprocess.run([str(ROOT / trainer["command"][0]), script, "--steps", "10", "--every", "5"],
                             env=child_env(PYTHON=sys.executable, **env), cwd=str(ROOT), capture_output=True,
                             text=True, timeout=300)
        assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
        assert "finished 10 steps" in job.stdout
        prefix = remote.path.strip("/")
        keys = s3.client().list_objects_v2(Bucket=remote.netloc, Prefix=prefix).get("Contents", [])
        assert f"{prefix}/{step_manifest(10)}" in [k["Key"] for k in keys], "close() returned before the upload"
    finally:
        if sidecar_proc is not None:
            sidecar_proc.send_signal(signal.SIGTERM)
            sidecar_proc.wait(timeout=60)
        s3.stop()


# --------------------------------------------------------------- docker compose

COMPOSE = DEPLOY / "compose" / "compose.yaml"


def compose_defaults(value):
    """The value as compose interpolates it with nothing set: ${VAR:-default} -> default."""
    if isinstance(value, str):
        return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)
    return value


def compose_services() -> dict[str, dict]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for svc in services.values():
        svc["environment"] = {k: compose_defaults(v) for k, v in svc.get("environment", {}).items()}
    return services


def test_compose_minio_bucket_and_trainer_agree():
    services = compose_services()
    minio, mc, trainer = services["minio"], services["create-bucket"], services["trainer"]
    assert minio["image"].startswith("minio/minio:") and mc["image"].startswith("minio/mc:")
    assert "healthcheck" in minio
    assert mc["depends_on"] == {"minio": {"condition": "service_healthy"}}
    assert trainer["depends_on"] == {"minio": {"condition": "service_healthy"},
                                     "create-bucket": {"condition": "service_completed_successfully"}}

    env = trainer["environment"]
    endpoint = urlparse(env["AWS_ENDPOINT_URL"])
    assert endpoint.hostname == "minio"
    assert option(minio["command"], "--address") == f":{endpoint.port}"
    assert env["AWS_ACCESS_KEY_ID"] == minio["environment"]["MINIO_ROOT_USER"] == mc["environment"]["MINIO_ROOT_USER"]
    assert (env["AWS_SECRET_ACCESS_KEY"] == minio["environment"]["MINIO_ROOT_PASSWORD"]
            == mc["environment"]["MINIO_ROOT_PASSWORD"])

    script = " ".join(mc["command"])
    alias = re.search(r"mc alias set (\S+) (\S+) \"\$\$MINIO_ROOT_USER\" \"\$\$MINIO_ROOT_PASSWORD\"", script)
    assert alias and alias.group(2) == env["AWS_ENDPOINT_URL"]
    bucket = re.search(rf"mc mb --ignore-existing {alias.group(1)}/(\S+)", script).group(1)
    assert urlparse(env["REMOTE"]).netloc == bucket and env["REMOTE"].startswith("s3://")

    assert trainer["command"][:2] == ["deploy/torchrun/launch.sh", "examples/train_ddp.py"]
    assert env["NPROC_PER_NODE"] == "2"
    grace = int(trainer["stop_grace_period"].rstrip("s"))
    assert float(env["SHARDCKPT_DRAIN_TIMEOUT_S"]) < int(env["SHUTDOWN_TIMEOUT"]) < grace


def test_compose_image_installs_cpu_torch_then_the_pinned_project():
    trainer = compose_services()["trainer"]
    context = (COMPOSE.parent / trainer["build"]["context"]).resolve()
    assert context == ROOT
    dockerfile = context / trainer["build"]["dockerfile"]
    lines = [line.strip() for line in dockerfile.read_text().splitlines()]
    torch_line = next(i for i, line in enumerate(lines) if "pip install torch==2.13.0" in line)
    assert "--index-url https://download.pytorch.org/whl/cpu" in lines[torch_line]
    project_line = next(i for i, line in enumerate(lines) if "pip install -c deploy/constraints.txt ." in line)
    assert torch_line < project_line
    # Every COPY source exists and gets past the Dockerfile's own ignore file.
    allowed = [line[1:] for line in (dockerfile.parent / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for line in lines:
        if line.startswith("COPY "):
            for source in shlex.split(line)[1:-1]:
                assert (context / source).exists(), source
                assert source in allowed, f"{source} is excluded by Dockerfile.dockerignore"


def test_compose_trainer_settings_upload_to_s3(tmp_path):
    """The compose trainer's command and environment, against a local S3 server instead of MinIO."""
    trainer = compose_services()["trainer"]
    env = dict(trainer["environment"])
    s3 = S3Server()
    try:
        remote = urlparse(env["REMOTE"])
        s3.client().create_bucket(Bucket=remote.netloc)  # what the create-bucket service does
        env.update(s3.env(), CKPT_DIR=str(tmp_path / "ckpt"))
        argv = list(trainer["command"])
        argv[argv.index("--steps") + 1] = "10"
        argv[argv.index("--step-sleep") + 1] = "0"
        job = subprocess.run([str(ROOT / argv[0]), *argv[1:]], env=child_env(PYTHON=sys.executable, **env),
                             cwd=str(ROOT), capture_output=True, text=True, timeout=300)
        assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
        prefix = remote.path.strip("/")
        keys = [k["Key"] for k in s3.client().list_objects_v2(Bucket=remote.netloc, Prefix=prefix)["Contents"]]
        assert f"{prefix}/{step_manifest(10)}" in keys, "the last step is committed in the bucket on exit"
    finally:
        stop_uploaders(tmp_path, grace_s=30.0)
        s3.stop()


# --------------------------------------------------------------- systemd


def test_systemd_unit_runs_the_uploader_and_restarts_it():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    text = (DEPLOY / "shardckpt-sync.service").read_text()
    unit.read_string(text)
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/shardckpt") and argv[1] == "sync"
    for flag in ("--local", "--remote"):
        value = option(argv, flag)
        var = re.fullmatch(r"\$\{(\w+)\}", value).group(1)
        assert re.search(rf"^#\s+{var}=", text, re.M), f"{var} is not documented for the EnvironmentFile"
    assert service["Restart"] in ("on-failure", "always")
    assert service["EnvironmentFile"]
    assert unit["Install"]["WantedBy"]


def test_fsdp2_example_resumes_at_half_the_world_size_with_the_accumulation_of_the_plan(tmp_path):
    """examples/train_fsdp2.py (the README's FSDP2 quick start): 2 ranks to step 20, then 1 rank to 30,
    ending bitwise where 2 ranks straight to 30 end (the plan keeps the global batch)."""
    import shutil

    from helpers import run_torchrun

    from shardckpt import cli
    from shardckpt.format import layout

    example = ROOT / "examples" / "train_fsdp2.py"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = run_torchrun(2, example, "--ckpt-dir", straight, "--steps", "30", "--every", "10", timeout=300)
    assert "starting fresh at world size 2, 1 micro-batch(es) per step" in first.stdout
    assert "finished at step 30" in first.stdout
    # The job stopped at step 20 on 2 ranks: its directory holds step 20 (a copy of that run's own).
    resumed.mkdir()
    shutil.copytree(straight / layout.step_dirname(20), resumed / layout.step_dirname(20))
    second = run_torchrun(1, example, "--ckpt-dir", resumed, "--steps", "30", "--every", "10", timeout=300)
    assert "resuming from step 20 at world size 1, 2 micro-batch(es) per step" in second.stdout, second.stdout[-3000:]
    assert "world 2 -> 1, micro-batch 16 -> 16, accumulation 1 -> 2, global batch 32 -> 32" in second.stdout
    # Model and optimizer state at step 30, compared by value.
    for run in (straight, resumed):
        assert cli.main(["export", str(run), str(tmp_path / f"{run.name}.pt"), "--step", "30", "--format", "torch",
                         "--optimizer"]) == 0
    expected, actual = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert expected.keys() == actual.keys() and any(k.startswith("optimizer.") for k in expected)
    for key, value in expected.items():
        assert torch.equal(value, actual[key]) if torch.is_tensor(value) else value == actual[key], key
