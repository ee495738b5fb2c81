"""The learner's launchers (ops/learn/launch.py) without running a step: each one's command line
or manifest, the Kubernetes launcher against a stand-in for the API server (submission, waiting,
failure, clean-up), and bad configurations as one-line errors, in the asset a dg.Failure.
The launchers that run processes run real steps in tests/test_learner_multinode.py."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import dagster as dg
import kubernetes.client as k8s
import pytest
from kubernetes.client.exceptions import ApiException

from ops.cluster.config import ClusterConfig, LearnerJobConfig
from ops.cluster.validate import check_object
from ops.learn.launch import (COLLECTIVE_TIMEOUT_ENV, REPO_ROOT, KubernetesJob, LaunchError, LocalTorchrun,
                              MultiNodeTorchrun, TorchrunNodes, make_launcher)

JOB = Path("/perpetua/models/learner/jobs/3f1c9a52-8d7e-4b1a-9c2e-0d6f4e5a7b81.json")
PIPES_ENV = {"DAGSTER_PIPES_CONTEXT": "eJyrVkrOzy0oSi0uTk1RslIqSS0uUaoFAEcxBt4=", "DAGSTER_PIPES_MESSAGES": "eJyrVg=="}


def test_local_is_todays_command():
    from ops.learn.main import launch_command

    expected = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "ops.learn.main", "--config", str(JOB)]
    assert LocalTorchrun(nproc_per_node=2).command(JOB) == launch_command(JOB, 2) == expected
    assert LocalTorchrun().env()["PYTHONPATH"].split(":")[0] == str(REPO_ROOT)


def test_multinode_command_per_node():
    def node(rank: int) -> MultiNodeTorchrun:
        return MultiNodeTorchrun(nodes=2, node_rank=rank, nproc_per_node=4, rdzv_endpoint="gpu-a:29400",
                                 rdzv_id="run-7", collective_timeout_s=120, local_addr=f"gpu-{'ab'[rank]}")

    zero, one = node(0).command(JOB), node(1).command(JOB)
    assert one == [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
                   "--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu-a:29400",
                   "--rdzv-id", "run-7", "--rdzv-conf", "is_host=0,join_timeout=600", "--max-restarts", "0",
                   "--local-addr", "gpu-b", "-m", "ops.learn.main", "--config", str(JOB)]
    # The nodes differ in their rank, address and which of them hosts the rendezvous store (node 0).
    assert [(a, b) for a, b in zip(zero, one) if a != b] == [
        ("0", "1"), ("is_host=1,join_timeout=600", "is_host=0,join_timeout=600"), ("gpu-a", "gpu-b")]
    assert node(0).env()[COLLECTIVE_TIMEOUT_ENV] == "120" and node(0).world_size == 8
    assert COLLECTIVE_TIMEOUT_ENV not in MultiNodeTorchrun(nodes=2, node_rank=0, rdzv_endpoint="h:1", rdzv_id="r").env()


def test_nodes_on_other_hosts_start_through_the_remote_shell():
    nodes = TorchrunNodes(hosts=["127.0.0.1", "gpu-b"], rdzv_port=29400, collective_timeout_s=60)
    assert nodes.argv(0, JOB, PIPES_ENV, "run") == nodes.node(0, "run").command(JOB)  # this machine: directly
    remote = nodes.argv(1, JOB, PIPES_ENV | {"X": "a b'c"}, "run")
    assert remote[:4] == ["ssh", "-o", "BatchMode=yes", "gpu-b"] and len(remote) == 5
    words = shlex.split(remote[4])
    assert words[:4] == ["cd", str(REPO_ROOT), "&&", "env"]
    assignments = dict(w.split("=", 1) for w in words[4:words.index(sys.executable)])
    assert assignments == {**nodes.node(1, "run").env(), **PIPES_ENV, "X": "a b'c"}
    assert words[words.index(sys.executable):] == nodes.node(1, "run").command(JOB)
    assert nodes.node(1, "run").rdzv_endpoint == "127.0.0.1:29400" and nodes.world_size == 2


def test_a_failed_node_ends_the_others_after_the_grace_period():
    import os
    import time

    from ops.learn.launch import start_process, wait_nodes

    # The stand-in for a healthy node's launcher takes SIGTERM's default action itself, as torchrun
    # handles it: a disposition of "ignored" is inherited through exec, and a test run before this
    # one in the same process may have left SIGTERM ignored.
    healthy = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_DFL); time.sleep(60)"]
    began = time.monotonic()
    procs = [start_process(healthy, os.environ), start_process(["sh", "-c", "sleep 0.3; exit 3"], os.environ),
             start_process(["true"], os.environ)]
    assert wait_nodes(procs, grace_s=0.5, poll_s=0.05) == [(1, 3), (0, -15)]  # ended by SIGTERM
    assert time.monotonic() - began < 5


class FakeKubernetes:
    """BatchV1Api and CoreV1Api as far as the launcher uses them: records calls, answers job
    status from a script, and says the learner's Service exists already."""

    def __init__(self, statuses: list[k8s.V1JobStatus]):
        self.calls: list[tuple] = []
        self.statuses = iter(statuses)

    def create_namespaced_service(self, namespace, body):
        self.calls.append(("create service", namespace, body))
        raise ApiException(status=409, reason="AlreadyExists")

    def create_namespaced_job(self, namespace, body):
        self.calls.append(("create job", namespace, body))

    def read_namespaced_job_status(self, name, namespace):
        self.calls.append(("read job", namespace, name))
        return k8s.V1Job(status=next(self.statuses))

    def delete_namespaced_job(self, name, namespace, propagation_policy=None):
        self.calls.append(("delete job", namespace, name, propagation_policy))


def kubernetes_job(statuses) -> tuple[KubernetesJob, FakeKubernetes]:
    api = FakeKubernetes(statuses)
    cluster = ClusterConfig(learner=LearnerJobConfig(nodes=2, gpus_per_node=8))
    return KubernetesJob(cluster=cluster, batch_api=api, core_api=api, poll_s=0.01), api


def test_kubernetes_job_submits_the_rendered_job_with_the_pipes_env():
    launcher, api = kubernetes_job([k8s.V1JobStatus(active=2), k8s.V1JobStatus(active=1, succeeded=1),
                                    k8s.V1JobStatus(succeeded=2)])
    assert launcher.world_size == 16
    launcher.run(JOB, PIPES_ENV | {"PERPETUA_HOME": "/perpetua"})
    kinds = [c[0] for c in api.calls]
    assert kinds == ["create service", "create job", "read job", "read job", "read job", "delete job"]
    service, job = api.calls[0][2], api.calls[1][2]
    assert check_object(service) == "Service/perpetua-learner"
    name = job["metadata"]["name"]
    assert check_object(job) == f"Job/{name}" and name == f"perpetua-learner-{JOB.stem}"
    assert api.calls[-1] == ("delete job", "perpetua", name, "Background")
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2 and pod["subdomain"] == "perpetua-learner"
    container = pod["containers"][0]
    cmd = container["command"]
    assert cmd[-2:] == ["--config", str(JOB)]
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == f"{name}-0.perpetua-learner.perpetua.svc.cluster.local:29500"
    env = [(e["name"], e.get("value")) for e in container["env"]]
    assert [n for n, _ in env].count("PERPETUA_HOME") == 1  # the renderer's, given once
    assert dict(env)["DAGSTER_PIPES_CONTEXT"] == PIPES_ENV["DAGSTER_PIPES_CONTEXT"]
    assert dict(env)["PERPETUA_LEARNER_RUN"] == name


def test_kubernetes_job_failure_is_a_launch_error_and_the_job_is_removed():
    failed = k8s.V1JobStatus(failed=1, conditions=[k8s.V1JobCondition(
        type="Failed", status="True", reason="BackoffLimitExceeded", message="Job has reached the specified backoff limit")])
    launcher, api = kubernetes_job([k8s.V1JobStatus(active=2), failed])
    with pytest.raises(LaunchError, match=r"learner Job perpetua/perpetua-learner-.* failed \(BackoffLimitExceeded"):
        launcher.run(JOB, PIPES_ENV)
    assert api.calls[-1][0] == "delete job"
    with pytest.raises(LaunchError, match="is not under PERPETUA_HOME as the learner pods mount it"):
        launcher.run(Path("/elsewhere/job.json"), PIPES_ENV)


@pytest.mark.parametrize("kind, settings, message", [
    ("slurm", {}, "unknown launcher 'slurm': choose one of local, persistent, multinode, kubernetes"),
    ("local", {"hosts": ["a"]}, "the local launcher takes no settings"),
    ("persistent", {"hosts": ["a"]}, "persistent launcher: hosts: Extra inputs are not permitted"),
    ("persistent", {"step_timeout_s": 0}, "persistent launcher: step_timeout_s: Input should be greater than 0"),
    ("multinode", {}, "multinode launcher: hosts: Field required"),
    ("multinode", {"hosts": ["a", "b"], "rdzv_prot": 1}, "multinode launcher: rdzv_prot: Extra inputs are not permitted"),
    ("kubernetes", {"cluster_config": "/no/cluster.yaml"}, "config file /no/cluster.yaml does not exist"),
    ("kubernetes", {"poll_s": 0}, "kubernetes launcher: poll_s: Input should be greater than 0"),
])
def test_bad_launcher_configuration_is_one_line(kind, settings, message):
    with pytest.raises(ValueError) as e:
        make_launcher(kind, 1, settings)
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="node_rank 2 is not one of the 2 nodes"):
        MultiNodeTorchrun(nodes=2, node_rank=2, rdzv_endpoint="h:1", rdzv_id="r")


@pytest.mark.parametrize("config, message", [
    ({"launcher": "slurm"}, "invalid launcher configuration: unknown launcher 'slurm'"),
    ({"launcher": "multinode", "launcher_settings_json": "{hosts"}, "invalid launcher configuration: Expecting"),
    ({"launcher": "multinode", "launcher_settings_json": '{"hosts": ["a", "b", "c"]}', "expert_parallel": 2},
     "expert_parallel=2 must divide the learner's 3 rank(s) (multinode launcher, nproc_per_node=1)"),
    ({"nproc_per_node": 3, "expert_parallel": 2}, "expert_parallel=2 must divide the learner's 3 rank(s)"),
])
def test_bad_launcher_configuration_fails_the_asset_clearly(perpetua_home, config, message):
    from assets.policy_checkpoint import policy_checkpoint
    from test_policy_checkpoint_asset import step_resources

    with dg.instance_for_test() as instance, pytest.raises(dg.Failure) as e:
        dg.materialize([policy_checkpoint], instance=instance,
                       run_config={"ops": {"policy_checkpoint": {"config": config}}}, resources=step_resources())
    assert message in str(e.value.description)
