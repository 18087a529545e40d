"""The Kubernetes manifests and the plain Prometheus config, checked against the daemon.

Every manifest must be valid YAML, and what the daemon reads or serves must agree with
the code: env var names are Settings fields and their values validate, ports and probe
paths are the daemon's ports and real routes, the socket and shared-memory directories
line up between the daemon and its client pods, and the timing knobs (startup probe,
termination grace) cover what the daemon needs.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from embcache.service.config import Settings, is_loopback

Docs = list[dict[str, Any]]

_QUANTITY = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "k": 1000, "M": 1000**2,
             "G": 1000**3, "T": 1000**4, "": 1}  # fmt: skip


def quantity_bytes(value: str | int) -> int:
    match = re.fullmatch(r"(\d+)([KMGT]i?|k)?", str(value))
    assert match, f"cannot read memory quantity {value!r}"
    return int(match.group(1)) * _QUANTITY[match.group(2) or ""]


@pytest.fixture(scope="module")
def manifests(repo: Path, load_yaml: Callable[[Path], Docs]) -> dict[Path, Docs]:
    root = repo / "deploy" / "kubernetes"
    files = sorted(root.rglob("*.yaml"))
    assert files, "no manifests"
    return {path.relative_to(root): load_yaml(path) for path in files}


def _one(manifests: dict[Path, Docs], kind: str, *, examples: bool = False) -> dict[str, Any]:
    found = [
        doc
        for path, docs in manifests.items()
        for doc in docs
        if doc.get("kind") == kind and (path.parts[0] == "examples") == examples
    ]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def daemonset(manifests: dict[Path, Docs]) -> dict[str, Any]:
    return _one(manifests, "DaemonSet")


@pytest.fixture(scope="module")
def pod_spec(daemonset: dict[str, Any]) -> dict[str, Any]:
    return daemonset["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod_spec["containers"] if c["name"] == "embcache"]
    return container


def _resolve_env(
    container: dict[str, Any], manifests: dict[Path, Docs], *, namespace: str
) -> dict[str, str]:
    """The environment a container gets: envFrom ConfigMaps, then env entries, with
    secretKeyRef values taken from the example Secret."""
    by_kind_name = {
        (doc["kind"], doc["metadata"]["name"]): doc
        for docs in manifests.values()
        for doc in docs
        if "metadata" in doc  # not the Kustomization
    }
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        config_map = by_kind_name[("ConfigMap", ref)]
        assert config_map["metadata"]["namespace"] == namespace
        env.update({k: str(v) for k, v in config_map["data"].items()})
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item["valueFrom"]["secretKeyRef"]
        secret = by_kind_name[("Secret", ref["name"])]
        assert secret["metadata"]["namespace"] == namespace
        env[item["name"]] = secret["stringData"][ref["key"]]
    return env


@pytest.fixture
def daemon_settings(
    container: dict[str, Any],
    daemonset: dict[str, Any],
    manifests: dict[Path, Docs],
    settings_from_env: Callable[[dict[str, str]], Settings],
) -> Settings:
    env = _resolve_env(container, manifests, namespace=daemonset["metadata"]["namespace"])
    return settings_from_env(env)


def _port(container: dict[str, Any], name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name_or_number]
    return int(port)


def _mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume behind it."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


# -- every manifest ------------------------------------------------------------------------


def test_every_manifest_is_a_named_kubernetes_object(manifests: dict[Path, Docs]) -> None:
    for path, docs in manifests.items():
        assert docs, f"{path} is empty"
        for doc in docs:
            if doc.get("kind") == "Kustomization":
                continue
            assert doc.get("apiVersion") and doc.get("kind"), path
            assert doc["metadata"].get("name"), path
            if doc["kind"] != "Namespace":
                assert doc["metadata"].get("namespace") == "embcache", path


def test_kustomization_lists_the_daemon_but_no_example_secret(
    repo: Path, manifests: dict[Path, Docs]
) -> None:
    kustomization = manifests[Path("kustomization.yaml")][0]
    resources = kustomization["resources"]
    for name in resources:
        assert (repo / "deploy" / "kubernetes" / name).is_file(), name
    assert "secret.example.yaml" not in resources, "a placeholder token must not be applied"
    assert not any(name.startswith("examples/") for name in resources)
    kinds = {doc["kind"] for name in resources for doc in manifests[Path(name)]}
    assert {"DaemonSet", "ConfigMap", "Service", "ServiceMonitor"} <= kinds


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (offline use only)")
def test_kustomize_builds(repo: Path) -> None:
    done = subprocess.run(
        ["kubectl", "kustomize", str(repo / "deploy" / "kubernetes")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "kind: DaemonSet" in done.stdout


# -- the DaemonSet -------------------------------------------------------------------------


def test_env_names_are_settings_and_values_validate(
    container: dict[str, Any], daemon_settings: Settings
) -> None:
    # Pod IP for metrics scraping: a non-loopback bind, which the daemon only accepts
    # with a token; the token comes from the Secret.
    assert not is_loopback(daemon_settings.http_host)
    assert daemon_settings.auth_token
    token = [e for e in container["env"] if e["name"] == "EMBCACHE_AUTH_TOKEN"]
    assert token and "secretKeyRef" in token[0]["valueFrom"], "the token comes from a Secret"


def test_the_token_is_required_by_the_daemon(
    container: dict[str, Any],
    daemonset: dict[str, Any],
    manifests: dict[Path, Docs],
    settings_from_env: Callable[[dict[str, str]], Settings],
) -> None:
    env = _resolve_env(container, manifests, namespace=daemonset["metadata"]["namespace"])
    del env["EMBCACHE_AUTH_TOKEN"]
    with pytest.raises(ValueError, match="non-loopback bind"):
        settings_from_env(env)


def test_ports_match_the_settings(container: dict[str, Any], daemon_settings: Settings) -> None:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": daemon_settings.grpc_port,
        "http": daemon_settings.http_port,
        "lane": daemon_settings.session_socket_tcp_port,
    }
    defaults = Settings()
    assert (daemon_settings.grpc_port, daemon_settings.http_port) == (
        defaults.grpc_port,
        defaults.http_port,
    )


@pytest.mark.parametrize(
    ("probe", "path"),
    [("startupProbe", "/livez"), ("livenessProbe", "/livez"), ("readinessProbe", "/readyz")],
)
def test_probes_hit_real_routes_on_the_http_port(
    container: dict[str, Any],
    daemon_settings: Settings,
    serves_get: Callable[[str], bool],
    probe: str,
    path: str,
) -> None:
    http_get = container[probe]["httpGet"]
    assert http_get["path"] == path and serves_get(path)
    assert _port(container, http_get["port"]) == daemon_settings.http_port
    assert http_get.get("scheme", "HTTP") == "HTTP"  # no TLS in these manifests


def test_probes_need_no_token() -> None:
    # The kubelet sends no Authorization header: probe paths must stay public.
    from embcache.service.transport.http.middleware import is_public

    assert is_public("/livez") and is_public("/readyz")


def test_startup_probe_covers_pinning_the_pool(
    container: dict[str, Any], daemon_settings: Settings
) -> None:
    probe = container["startupProbe"]
    budget_s = probe["periodSeconds"] * probe["failureThreshold"]
    # docs/facts.md ("One shared-memory segment as the pinned host pool"): registering
    # pinned memory takes ~0.75 s per GiB; ~30 s for imports and CUDA start-up; 1.5x margin.
    pool_gib = daemon_settings.host_pool_bytes / 1024**3
    assert budget_s >= 1.5 * (30 + 0.75 * pool_gib), (budget_s, pool_gib)


def test_termination_grace_exceeds_the_drain(
    pod_spec: dict[str, Any], daemon_settings: Settings
) -> None:
    assert pod_spec["terminationGracePeriodSeconds"] >= daemon_settings.drain_grace_s + 10


def test_memory_limit_covers_the_pool(container: dict[str, Any], daemon_settings: Settings) -> None:
    # The pool's shared-memory pages are charged to the daemon's cgroup.
    for kind in ("requests", "limits"):
        memory = quantity_bytes(container["resources"][kind]["memory"])
        assert memory > daemon_settings.host_pool_bytes, kind


def test_gpu_access_without_taking_a_gpu(
    pod_spec: dict[str, Any], container: dict[str, Any], daemon_settings: Settings
) -> None:
    for kind in ("requests", "limits"):
        assert not any("gpu" in r for r in container["resources"].get(kind, {}))
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert pod_spec["nodeSelector"], "GPU nodes only"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec["tolerations"])


def test_no_host_namespaces_and_a_hardened_container(
    pod_spec: dict[str, Any], container: dict[str, Any], repo: Path
) -> None:
    # POSIX-fd CUDA handles travel over the socket: no hostIPC / hostPID (docs/deploy.md).
    for flag in ("hostIPC", "hostPID", "hostNetwork"):
        assert not pod_spec.get(flag), flag
    pod_ctx = pod_spec["securityContext"]
    assert pod_ctx["runAsNonRoot"] is True
    dockerfile = (repo / "Dockerfile").read_text()
    uid = re.search(r"^ARG EMBCACHE_UID=(\d+)$", dockerfile, re.MULTILINE)
    assert uid and pod_ctx["runAsUser"] == int(uid.group(1)), "the image's UID"
    ctx = container["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx["capabilities"].get("add")
    assert not ctx.get("privileged")


def test_device_pools_are_shared_through_the_socket_directory(
    pod_spec: dict[str, Any], container: dict[str, Any], daemon_settings: Settings
) -> None:
    mounts = _mounts(pod_spec, container)
    fd_socket = daemon_settings.effective_ipc_socket
    assert daemon_settings.grpc_socket is not None
    assert fd_socket.parent == daemon_settings.grpc_socket.parent
    assert "hostPath" in mounts[str(fd_socket.parent)]
    if daemon_settings.ipc_mode == "legacy":  # cudaIpcMemHandle: shared IPC + PID namespaces
        assert pod_spec.get("hostIPC") and pod_spec.get("hostPID")
    else:
        assert daemon_settings.ipc_mode == "fd"


def test_socket_and_pool_directories_are_host_paths(
    pod_spec: dict[str, Any], container: dict[str, Any], daemon_settings: Settings
) -> None:
    mounts = _mounts(pod_spec, container)
    assert daemon_settings.grpc_socket is not None
    socket_dir = str(daemon_settings.grpc_socket.parent)
    assert "hostPath" in mounts[socket_dir], "clients on the node share the socket directory"
    # The pool segment lives in /dev/shm: node memory, shared with client pods.
    shm = mounts["/dev/shm"]
    assert shm["hostPath"]["path"].startswith("/dev/shm"), "a directory of the node's tmpfs"
    # The init container hands both host directories to the daemon's user.
    (init,) = pod_spec["initContainers"]
    init_mounts = _mounts(pod_spec, init)
    script = " ".join(init["command"])
    uid = pod_spec["securityContext"]["runAsUser"]
    for volume in (mounts[socket_dir], shm):
        (path,) = [p for p, v in init_mounts.items() if v is volume]
        assert path in script and f"chown {uid}:{uid}" in script


def test_rolling_update_never_runs_two_daemons_on_a_node(daemonset: dict[str, Any]) -> None:
    rolling = daemonset["spec"]["updateStrategy"]["rollingUpdate"]
    assert rolling.get("maxSurge", 0) == 0


# -- the example client pods ---------------------------------------------------------------


@pytest.mark.parametrize("role", ["encoder", "decoder"])
def test_client_pods_reach_the_daemon(
    role: str,
    manifests: dict[Path, Docs],
    pod_spec: dict[str, Any],
    container: dict[str, Any],
    daemon_settings: Settings,
) -> None:
    (pod,) = manifests[Path("examples") / f"{role}-pod.yaml"]
    assert pod["kind"] == "Pod"
    spec = pod["spec"]
    (client,) = spec["containers"]
    for flag in ("hostIPC", "hostPID", "hostNetwork"):
        assert not spec.get(flag), f"{role}: {flag} is not needed"
    # Same socket path through the same host directory.
    env = {e["name"]: e for e in client["env"]}
    socket = Path(env["EMBCACHE_SOCKET"]["value"])
    assert socket == daemon_settings.grpc_socket
    daemon_mounts = _mounts(pod_spec, container)
    client_mounts = _mounts(spec, client)
    for path in (str(socket.parent), "/dev/shm"):
        assert client_mounts[path]["hostPath"]["path"] == daemon_mounts[path]["hostPath"]["path"]
    # The socket and the pool segment are owner-only: same UID as the daemon.
    assert spec["securityContext"]["runAsUser"] == pod_spec["securityContext"]["runAsUser"]
    # Same token as the daemon.
    daemon_token = next(e for e in container["env"] if e["name"] == "EMBCACHE_AUTH_TOKEN")
    assert env["EMBCACHE_TOKEN"]["valueFrom"] == daemon_token["valueFrom"]
    # The client's own GPU; the script is valid Python using the client library.
    assert client["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert client["command"][:2] == ["python3", "-c"]
    script = client["args"][0]
    compile(script, f"{role}-pod.yaml", "exec")
    assert "EmbCacheClient" in script


# -- metrics: Service, ServiceMonitor, NetworkPolicy, plain scrape config ------------------


def test_headless_service_selects_the_daemon(
    manifests: dict[Path, Docs], daemonset: dict[str, Any], container: dict[str, Any]
) -> None:
    service = _one(manifests, "Service")
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert _port(container, port["targetPort"]) == Settings().http_port


def test_service_monitor_scrapes_metrics_with_the_token(
    manifests: dict[Path, Docs], serves_get: Callable[[str], bool]
) -> None:
    service = _one(manifests, "Service")
    monitor = _one(manifests, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and serves_get("/metrics")
    # /metrics is not public once a token is set.
    from embcache.service.transport.http.middleware import is_public

    assert not is_public("/metrics")
    credentials = endpoint["authorization"]["credentials"]
    secret = _one(manifests, "Secret")
    assert credentials["name"] == secret["metadata"]["name"]
    assert credentials["key"] in secret["stringData"]


def test_network_policy_opens_the_http_port(
    manifests: dict[Path, Docs], container: dict[str, Any], daemonset: dict[str, Any]
) -> None:
    policy = _one(manifests, "NetworkPolicy")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    ports = [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert [_port(container, p) for p in ports] == [Settings().http_port]


def test_plain_prometheus_scrape_config(
    repo: Path,
    load_yaml: Callable[[Path], Docs],
    container: dict[str, Any],
    serves_get: Callable[[str], bool],
) -> None:
    (config,) = load_yaml(repo / "deploy" / "prometheus" / "scrape-config.yaml")
    jobs = config["scrape_configs"]
    assert jobs
    for job in jobs:
        assert job["metrics_path"] == "/metrics" and serves_get(job["metrics_path"])
        assert job["authorization"]["type"] == "Bearer"
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                assert int(target.rsplit(":", 1)[1]) == Settings().http_port
    (k8s,) = [job for job in jobs if "kubernetes_sd_configs" in job]
    keeps = {
        tuple(rule["source_labels"]): rule["regex"]
        for rule in k8s["relabel_configs"]
        if rule.get("action") == "keep"
    }
    port_name = keeps[("__meta_kubernetes_pod_container_port_name",)]
    assert _port(container, port_name) == Settings().http_port


def test_init_container_script_is_a_plain_shell_command(pod_spec: dict[str, Any]) -> None:
    (init,) = pod_spec["initContainers"]
    assert init["command"][:2] == ["/bin/sh", "-c"]
    shlex.split(init["command"][2])  # balanced quoting
    assert init["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert set(init["securityContext"]["capabilities"]["add"]) <= {"CHOWN", "FOWNER"}
