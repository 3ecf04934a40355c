"""k8s/examples/multinode: the LeaderWorkerSet that serves one model across nodes (tensor parallel
within a node, pipeline parallel across them, Ray between them) and its leader-only Service."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.tooling.k8s import (
    built,
    container_env,
    default_settings,
    is_settings_field,
    matches,
    named_port,
    one,
    settings_from,
)


def leader_worker() -> tuple[dict, dict, dict, dict]:
    lws = one(built("multinode"), "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    return lws, template, leader, worker


def test_multinode_parallelism(clean_env: pytest.MonkeyPatch) -> None:
    objects = built("multinode")
    _, template, leader, worker = leader_worker()
    [leader_container] = leader["spec"]["containers"]
    [worker_container] = worker["spec"]["containers"]
    env = container_env(objects, leader_container)
    assert [key for key in env if key.startswith("GATEWAY_") and not is_settings_field(key)] == []
    engine = settings_from(clean_env, env).engine
    assert engine.tensor_parallel_size == 8
    assert engine.pipeline_parallel_size == 2
    assert engine.engine_args == {"distributed_executor_backend": "ray"}
    # TP within a node (its GPUs), PP across the nodes of the group
    for container in (leader_container, worker_container):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == engine.tensor_parallel_size
        assert container["image"] == leader_container["image"]
        assert container["image"].endswith(
            "-gpu"
        )
        assert any(
            Path(engine.model).is_relative_to(m["mountPath"]) for m in container["volumeMounts"]
        )
    assert template["size"] == engine.pipeline_parallel_size
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_multinode_commands() -> None:
    _, _, leader, worker = leader_worker()
    [leader_container] = leader["spec"]["containers"]
    [worker_container] = worker["spec"]["containers"]
    shell, flag, script = leader_container["command"]
    assert (shell, flag) == ("/bin/bash", "-c")
    assert "ray start --head --port=6379" in script
    assert script.index("ray start --head") < script.index("exec python -m gateway serve")
    syntax = subprocess.run(
        ["bash", "-n"], check=False, input=script, text=True, capture_output=True
    )
    assert syntax.returncode == 0, syntax.stderr
    waiting = re.search(r"<<'PY'\n(.*?)\nPY\n", script, re.DOTALL)
    assert waiting
    assert "LWS_GROUP_SIZE" in waiting.group(1)
    compile(waiting.group(1), "leader-wait", "exec")
    assert "ray start --address=$(LWS_LEADER_ADDRESS):6379 --block" in " ".join(
        worker_container["command"]
    )


def test_multinode_leader_serves(clean_env: pytest.MonkeyPatch) -> None:
    objects = built("multinode")
    lws, _, leader, worker = leader_worker()
    [container] = leader["spec"]["containers"]
    port = default_settings().port
    assert named_port(container, "http") == port
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    drain = float(container_env(objects, container)["GATEWAY_DRAIN_TIMEOUT_S"])
    assert leader["spec"]["terminationGracePeriodSeconds"] > 5 + drain + 10
    service = one(objects, "Service", "llm-gateway-405b")
    leader_labels = leader["metadata"]["labels"] | {
        "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]
    }
    worker_labels = worker["metadata"]["labels"] | {
        "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]
    }
    assert matches(service["spec"]["selector"], leader_labels)
    assert not matches(service["spec"]["selector"], worker_labels)
    assert service["spec"]["ports"][0]["port"] == port
    monitor = one(objects, "ServiceMonitor", "llm-gateway-405b")
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
