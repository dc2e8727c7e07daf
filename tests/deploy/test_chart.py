"""The Helm chart: lint, Kubernetes schemas, and what the rendered objects must say to the services they run."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
import yaml

from engine_core.spec_decode.config import SpeculativeConfig
from services.common.engine_flags import field_default
from services.common.health import LIVENESS_SERVICE
from services.model_fetch import parse_args as parse_fetch_args
from services.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, WORKER_SERVICE
from tests.deploy.conftest import CHART, NAMESPACE, PROFILES, REPLICATED, Rendered, helm, helm_template, profile_args
from tests.deploy.pagoda_args import arg_value, container_env, pagoda_containers, parse_container

# The oldest Kubernetes the chart supports (gRPC probes are GA in 1.27) and the newest offline schema.
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
READINESS = {"frontend": GENERATION_SERVICE, "scheduler": SCHEDULER_SERVICE, "worker": WORKER_SERVICE}
# The shared contract's drain timeouts (seconds), under Kubernetes' default 30 s grace.
DRAIN = {"frontend": 20, "scheduler": 20, "worker": 25}
COMPONENT = "app.kubernetes.io/component"
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


@pytest.mark.parametrize("profile", PROFILES)
def test_helm_lint_strict(profile: str) -> None:
    out = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *profile_args(profile))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("profile", PROFILES)
def test_objects_match_the_kubernetes_schemas(render: Any, profile: str) -> None:
    for obj in render(profile).objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue  # no schema offline: test_custom_resources checks them
        for version in KUBERNETES_VERSIONS:
            # NOTE: SchemaNotFoundError on a built-in kind is a failure too (it propagates).
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("profile", ["observability", "secured+observability"])
def test_custom_resources(render: Any, profile: str) -> None:
    r: Rendered = render(profile)
    kinds = {(o["apiVersion"], o["kind"]) for o in r.objects}
    assert kinds >= CUSTOM_KINDS
    (monitor,) = r.by_kind["ServiceMonitor"]
    scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [s for s in r.by_kind["Service"] if selector.items() <= s["metadata"]["labels"].items()]
    # Every Pagoda service exposes a scraped port: /metrics on the frontend's HTTP port, the others' metrics port.
    for component in READINESS:
        svc = next(s for s in services if s["metadata"]["labels"][COMPONENT] == component)
        assert scraped & {p["name"] for p in svc["spec"]["ports"]}, component
    (scaled,) = r.by_kind["ScaledObject"]
    target = scaled["spec"]["scaleTargetRef"]
    assert r.get(target["kind"], target["name"]) is r.component("frontend")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and "pagoda:num_requests_waiting" in trigger["metadata"]["query"]
    # KEDA owns the frontend's replica count then: no HPA of the chart's own competing with it.
    assert "HorizontalPodAutoscaler" not in r.by_kind and "replicas" not in r.component("frontend")["spec"]


def _probe_target(probe: dict[str, Any]) -> tuple[int, str]:
    if "grpc" in probe:
        return probe["grpc"]["port"], probe["grpc"]["service"]
    from services.common.probe import parse_probe_args

    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "services.common.probe"]
    args = parse_probe_args(command[3:])  # the real probe parser accepts it
    host, _, port = args.addr.rpartition(":")
    assert host == "127.0.0.1"
    return int(port), args.service


@pytest.mark.parametrize("profile", PROFILES)
def test_probes_use_registered_health_names_on_container_ports(render: Any, profile: str) -> None:
    for component, container in pagoda_containers(render(profile)):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        grpc_port = ports.get("grpc") or ports["worker-grpc"]  # NOTE: port names are unique within the engine pod
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            port, service = _probe_target(container[kind])
            assert port == grpc_port, (component, kind)
            expected = LIVENESS_SERVICE if kind == "livenessProbe" else READINESS[component]
            assert service == expected, (component, kind)
        # The startup budget covers a model load: minutes, not the readiness probe's seconds.
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
        if "secured" in profile.split("+"):
            assert "exec" in container["livenessProbe"]  # the kubelet's gRPC probe speaks plaintext only
        else:
            assert "grpc" in container["livenessProbe"]


@pytest.mark.parametrize("profile", PROFILES)
def test_services_select_their_pods(render: Any, profile: str) -> None:
    r: Rendered = render(profile)
    for svc in r.by_kind["Service"]:
        selector = svc["spec"]["selector"]
        matched = [w for w in r.workloads() if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, svc["metadata"]["name"]
        assert matched[0]["metadata"]["labels"][COMPONENT] == selector[COMPONENT]
        names = {p["name"] for c in pod_spec(matched[0])["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names, svc["metadata"]["name"]
    for w in r.workloads():
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize(
    ("profile", "domain"),
    [("default", "cluster.local"), ("tensor-parallel", "cluster.local"), ("extras", "k8s.example.internal")],
)
def test_scheduler_gets_the_worker_dns_names_in_rank_order(render: Any, profile: str, domain: str) -> None:
    r: Rendered = render(profile)
    workers = r.component("worker")
    headless = r.get("Service", workers["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    name, svc, replicas = workers["metadata"]["name"], headless["metadata"]["name"], workers["spec"]["replicas"]
    port = next(p["containerPort"] for p in pod_spec(workers)["containers"][0]["ports"] if p["name"] == "grpc")
    expected = [f"{name}-{rank}.{svc}.{NAMESPACE}.svc.{domain}:{port}" for rank in range(replicas)]
    containers = dict(pagoda_containers(r))
    assert parse_container(r, "scheduler", containers["scheduler"]).worker_addrs == expected
    assert replicas == (3 if profile == "tensor-parallel" else 1)
    scheduler = parse_container(r, "scheduler", containers["scheduler"])
    worker = parse_container(r, "worker", containers["worker"])
    assert worker.engine.tensor_parallel_size == replicas  # every rank and the scheduler agree on the group's size
    if replicas > 1:  # the rendezvous: rank 0's stable name, on the port its headless Service names
        dist = next(p["port"] for p in headless["spec"]["ports"] if p["name"] == "dist")
        assert scheduler.dist_init_addr == f"{name}-0.{svc}.{NAMESPACE}.svc.{domain}:{dist}"
        rank_env = next(e for e in containers["worker"]["env"] if e["name"] == "PAGODA_RANK")
        assert rank_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    # ...and the frontends the scheduler's Service.
    scheduler_svc = next(s for s in r.by_kind["Service"] if s["metadata"]["labels"][COMPONENT] == "scheduler")
    sched_port = next(p["port"] for p in scheduler_svc["spec"]["ports"] if p["name"] == "grpc")
    addr = f"{scheduler_svc['metadata']['name']}.{NAMESPACE}.svc.{domain}:{sched_port}"
    assert parse_container(r, "frontend", containers["frontend"]).scheduler_addr == addr
    if domain != "cluster.local":
        assert "cluster.local" not in r.text  # nothing else assumes the default domain


@pytest.mark.parametrize("profile", PROFILES)
def test_every_command_line_is_accepted_by_the_pagoda_parsers(render: Any, profile: str) -> None:
    r: Rendered = render(profile)
    seen = set()
    for component, container in pagoda_containers(r):
        config = parse_container(r, component, container)
        seen.add(component)
        assert config.host == "0.0.0.0"  # pods are reached on their pod IP (probes, peers)
        assert config.drain_timeout == DRAIN[component]
        grace = pod_spec(r.component(component))["terminationGracePeriodSeconds"]
        assert config.drain_timeout < grace <= 30 + 10
    assert seen == set(READINESS)


def test_engine_settings_reach_the_services(render: Any) -> None:
    r: Rendered = render("gpu")
    containers = dict(pagoda_containers(r))
    worker = parse_container(r, "worker", containers["worker"]).engine
    assert (worker.dtype, worker.device, worker.attention_backend) == ("bfloat16", "cuda", "triton")
    scheduler = parse_container(r, "scheduler", containers["scheduler"])
    assert scheduler.max_num_seqs == worker.max_num_seqs == 128
    cpu = dict(pagoda_containers(render("cpu")))
    assert parse_container(render("cpu"), "worker", cpu["worker"]).engine.num_threads == 4


def test_a_draft_model_speculative_config_reaches_the_worker_and_the_scheduler() -> None:
    """engine.speculativeConfig with method draft_model: the worker loads the draft, the scheduler schedules it."""
    value = '{"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3}'
    out = helm_template(*profile_args("cpu"), "--set-json", f"engine.speculativeConfig={value}")
    assert out.returncode == 0, out.stderr
    r = Rendered("cpu", [o for o in yaml.safe_load_all(out.stdout) if o])
    containers = dict(pagoda_containers(r))
    worker = parse_container(r, "worker", containers["worker"]).engine.speculative_config
    scheduler = parse_container(r, "scheduler", containers["scheduler"]).speculative_config
    assert worker == scheduler
    assert (worker.method, worker.model, worker.num_speculative_tokens) == ("draft_model", "/models/draft", 3)


@pytest.mark.parametrize("profile", PROFILES)
def test_security_context_and_resources_on_every_container(render: Any, profile: str) -> None:
    for w in render(profile).workloads():
        spec = pod_spec(w)
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True
        assert spec["automountServiceAccountToken"] is False
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False and sc.get("privileged", False) is False
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
            assert (sc.get("seccompProfile") or pod_sc["seccompProfile"])["type"] == "RuntimeDefault"
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= c["resources"][bound].keys(), (c["name"], bound)
            # A read-only root needs writable /tmp; torch needs a real /dev/shm.
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, c["name"]
            if c["name"] != "jaeger":
                assert "/dev/shm" in mounts
                shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
                assert shm["emptyDir"]["medium"] == "Memory"


def test_scheduler_is_a_single_recreated_replica(render: Any) -> None:
    for profile in [p for p in PROFILES if p not in REPLICATED]:
        scheduler = render(profile).component("scheduler")
        assert scheduler["kind"] == "Deployment" and scheduler["spec"]["replicas"] == 1
        assert scheduler["spec"]["strategy"] == {"type": "Recreate"}


def test_gpu_and_cpu_profiles(render: Any) -> None:
    gpu = pod_spec(render("gpu").component("worker"))
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["runtimeClassName"] == "nvidia" and gpu["nodeSelector"] and gpu["tolerations"]
    for profile in ("default", "cpu"):
        cpu = pod_spec(render(profile).component("worker"))
        assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["limits"]
        assert "runtimeClassName" not in cpu


def _policy(r: Rendered, component: str) -> dict[str, Any]:
    return next(
        p for p in r.by_kind["NetworkPolicy"] if p["spec"]["podSelector"]["matchLabels"][COMPONENT] == component
    )


def test_network_policies_only_frontends_reach_the_scheduler_and_only_it_the_workers(render: Any) -> None:
    r: Rendered = render("default")
    for component, caller in (("scheduler", "frontend"), ("worker", "scheduler")):
        policy = _policy(r, component)
        container = pod_spec(r.component(component))["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        rules = policy["spec"]["ingress"]
        grpc_rules = [rule for rule in rules if any(p["port"] == ports["grpc"] for p in rule["ports"])]
        assert len(grpc_rules) == 1
        (peer,) = grpc_rules[0]["from"]
        caller_labels = r.component(caller)["spec"]["template"]["metadata"]["labels"]
        assert peer["podSelector"]["matchLabels"].items() <= caller_labels.items()
        assert peer["podSelector"]["matchLabels"][COMPONENT] == caller
        # Metrics scraping stays allowed (from anywhere by default).
        assert any(any(p["port"] == ports["metrics"] for p in rule["ports"]) for rule in rules)


def test_tracing_sets_the_otlp_endpoint_on_every_pod(render: Any) -> None:
    r: Rendered = render("observability")
    jaeger = next(s for s in r.by_kind["Service"] if s["metadata"]["labels"][COMPONENT] == "jaeger")
    assert 4317 in {p["port"] for p in jaeger["spec"]["ports"]}
    for component, container in pagoda_containers(r):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://{jaeger['metadata']['name']}:4317"
        assert env["OTEL_SERVICE_NAME"] == f"pagoda-{component}"
        assert arg_value(container, "--collect-detailed-traces") == "true"
    for _, container in pagoda_containers(render("default")):
        assert not any(e["name"].startswith("OTEL_") for e in container["env"])
    assert "16686" in r.notes and "port-forward" in r.notes


def test_secured_profile_mounts_secrets(render: Any) -> None:
    r: Rendered = render("secured")
    for component, container in pagoda_containers(r):
        spec = pod_spec(r.component(component))
        secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert "pagoda-tls" in secrets
        for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-file"):
            path = arg_value(container, flag)
            assert any(path.startswith(m["mountPath"] + "/") for m in container["volumeMounts"]), flag
        if component == "frontend":
            assert "pagoda-api-keys" in secrets
            assert arg_value(container, "--api-keys-file") == "/etc/pagoda/api-keys/api-keys"
            assert arg_value(container, "--prefix-cache-isolation") == "api-key"


@pytest.mark.parametrize(
    "profile",
    ["observability", "secured+observability", "gpu+secured+observability", "replicas+secured+observability"],
)
def test_service_monitor_scrapes_with_the_scheme_the_services_serve(render: Any, profile: str) -> None:
    """With TLS every /metrics endpoint is HTTPS (the frontend's HTTP port, the scheduler's and workers' metrics
    ports, all with the pod's certificate): the ServiceMonitor verifies them with the release's CA."""
    r: Rendered = render(profile)
    secured = "secured" in profile.split("+")
    (monitor,) = r.by_kind["ServiceMonitor"]
    endpoints = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    service_names = {s["metadata"]["name"] for s in r.by_kind["Service"]}
    scraped = (("http", ["frontend"]), ("metrics", ["scheduler", "worker"]))
    if profile in REPLICATED:  # the engine pods' workers: their own port on the engine's Service
        scraped += (("worker-metrics", ["worker"]),)
    for port, components in scraped:
        endpoint = endpoints[port]
        assert endpoint["scheme"] == ("https" if secured else "http"), port
        if not secured:
            assert "tlsConfig" not in endpoint
            continue
        tls = endpoint["tlsConfig"]
        assert tls["ca"]["secret"] == {"name": "pagoda-tls", "key": "ca.crt"}
        assert tls["serverName"] in service_names  # the certificate names every Service
        for component in components:
            container = r.container(component)
            # The service serves that port with its certificate: the TLS flags are on its command line.
            assert arg_value(container, "--tls-cert-file") and arg_value(container, "--tls-key-file"), component
            config = parse_container(r, component, container)
            assert config.tls.cert_file and config.tls.key_file
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            if port == "http":
                assert config.http_port == ports["http"]
            else:
                assert config.metrics_port == ports.get("metrics", ports.get("worker-metrics")), component


def test_escape_hatches_reach_every_component(render: Any) -> None:
    r: Rendered = render("extras")
    values = yaml.safe_load((CHART / "ci" / "extras-values.yaml").read_text())
    security = yaml.safe_load((CHART / "values.yaml").read_text())["containerSecurityContext"]
    for component in ("frontend", "scheduler", "worker"):
        want = values[component]
        spec = pod_spec(r.component(component))
        (container,) = spec["containers"]
        for env in want["extraEnv"]:
            assert env in container["env"], (component, env)
        volumes = {v["name"]: v for v in spec["volumes"]}
        for volume in want["extraVolumes"]:
            assert volumes[volume["name"]] == volume, component
        for mount in want["extraVolumeMounts"]:
            assert mount in container["volumeMounts"], component
        annotations = r.component(component)["spec"]["template"]["metadata"]["annotations"]
        assert want["podAnnotations"].items() <= annotations.items() and "checksum/engine" in annotations
        assert spec["priorityClassName"] == want["priorityClassName"]
        inits = spec.get("initContainers", [])
        assert [c["name"] for c in inits] == [c["name"] for c in want.get("initContainers", [])], component
        for init in inits:
            assert init["securityContext"] == security  # the chart's, as the profile set none
    # Unset, they render nothing.
    for component in ("frontend", "scheduler", "worker"):
        spec = pod_spec(render("default").component(component))
        assert "priorityClassName" not in spec and "initContainers" not in spec
        assert {v["name"] for v in spec["volumes"]} <= {"tmp", "dshm", "cache", "model"}


@pytest.mark.parametrize("profile", ["repository", "cpu+observability+extras+repository"])
def test_repository_weights_are_fetched_by_an_init_container(render: Any, profile: str) -> None:
    r: Rendered = render(profile)
    repository = yaml.safe_load((CHART / "ci" / "repository-values.yaml").read_text())["model"]["repository"]
    for component in ("frontend", "worker"):
        spec = pod_spec(r.component(component))
        (container,) = spec["containers"]
        fetch = spec["initContainers"][0]  # before the operator's own init containers
        assert fetch["name"] == "model-fetch" and fetch["command"] == ["python", "-m", "services.model_fetch"]
        config = parse_fetch_args(fetch["args"])  # the real parser accepts the rendered arguments
        assert (config.repo_url, config.revision) == (repository["url"], repository["revision"])
        assert config.include == tuple(repository["include"])
        # It fills the directory the service loads, on the volume the service mounts read-only.
        assert str(config.dest) == container_env(r, container)["PAGODA_MODEL"]
        (fetch_mount,) = [m for m in fetch["volumeMounts"] if m["name"] == "model"]
        (model_mount,) = [m for m in container["volumeMounts"] if m["name"] == "model"]
        assert not fetch_mount.get("readOnly") and model_mount["readOnly"] is True
        assert fetch_mount["mountPath"] == model_mount["mountPath"] and str(config.dest).startswith(
            fetch_mount["mountPath"] + "/"
        )
        # The token as a file from the Secret (never an environment variable), mounted in the init container only.
        assert "env" not in fetch and arg_value(fetch, "--token-file") == "/etc/pagoda/hf-token/HF_TOKEN"
        assert any(m["name"] == "hf-token" for m in fetch["volumeMounts"])
        assert not any(m["name"] == "hf-token" for m in container["volumeMounts"])
        secret = next(v for v in spec["volumes"] if v["name"] == "hf-token")["secret"]
        assert secret["secretName"] == "hf-token" and secret["items"] == [{"key": "HF_TOKEN", "path": "HF_TOKEN"}]
        volume = next(v for v in spec["volumes"] if v["name"] == "model")
        assert volume["emptyDir"]["sizeLimit"] == repository["sizeLimit"]
    scheduler = pod_spec(r.component("scheduler"))
    assert all(c["name"] != "model-fetch" for c in scheduler.get("initContainers", []))
    assert all(v["name"] != "hf-token" for v in scheduler["volumes"])
    assert "PersistentVolumeClaim" not in r.by_kind


def test_repository_weights_into_an_existing_claim() -> None:
    out = helm_template(*profile_args("repository"), "--set", "model.pvc.existingClaim=weights")
    assert out.returncode == 0, out.stderr
    objects = [o for o in yaml.safe_load_all(out.stdout) if o]
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]  # the operator's claim, written to
    worker = next(o for o in objects if o["kind"] == "StatefulSet")
    volume = next(v for v in pod_spec(worker)["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "weights"}


def test_notes_tell_how_to_call_generate(render: Any) -> None:
    notes = render("default").notes
    assert "kubectl -n llm port-forward svc/pg-pagoda-frontend 50051:50051" in notes
    assert "grpcurl -plaintext -d" in notes and f"{GENERATION_SERVICE}/Generate" in notes


@pytest.mark.parametrize(
    "bad",
    [
        "engine.tensorParallelSize=0",
        "worker.replicas=3",  # ranks are engine.tensorParallelSize; no replica mode of full copies
        "engine.dtype=int8",
        "frontend.grpcPort=70000",
        "model.source=s3",
        "frontend.unknownKey=1",
        "tracing.otlpEndpoint=jaeger:4317",
        "engine.device=cuda",  # a CUDA engine on workers without a GPU
        "security.prefixCacheIsolation=tenant",
        "scheduler.drainTimeout=-1",
        "clusterDomain=Cluster_Local",
        "model.source=repository",  # without model.repository.url
        "model.repository.url=ftp://example.com/a/b",
        "worker.extraEnv[0].value=x",  # an env var without a name
        "frontend.initContainers[0].name=no-image",
        "scheduler.priorityClassName=1",
        "worker.podAnnotations.a=1",
        "frontend.http.maxConnectionsPerClient=-1",
        "frontend.http.headerTimeout=0",
    ],
)
def test_schema_rejects_bad_values(bad: str) -> None:
    out = helm_template("--set", bad)
    assert out.returncode != 0
    assert "values don't meet the specifications of the schema" in out.stderr, out.stderr


def test_two_autoscalers_on_the_frontends_are_refused() -> None:
    out = helm_template("--set", "keda.enabled=true", "--set", "frontend.autoscaling.enabled=true")
    assert out.returncode != 0 and "enable one" in out.stderr, out.stderr


def test_frontend_http_limits_reach_the_frontend_only_when_set(render: Any) -> None:
    default = parse_container(render("default"), "frontend", dict(pagoda_containers(render("default")))["frontend"])
    values = [
        "frontend.http.headerTimeout=5",
        "frontend.http.maxConnectionsPerClient=0",
        "frontend.http.maxConnections=100",
    ]
    out = helm_template(*(arg for v in values for arg in ("--set", v)))
    assert out.returncode == 0, out.stderr
    r = Rendered("http", [o for o in yaml.safe_load_all(out.stdout) if o])
    frontend = parse_container(r, "frontend", dict(pagoda_containers(r))["frontend"]).http_connections
    assert (frontend.header_timeout, frontend.max_connections_per_client, frontend.max_connections) == (5.0, 0, 100)
    assert frontend.body_timeout == default.http_connections.body_timeout  # unset: the frontend's own default


def test_speculative_config_reaches_the_scheduler(render: Any) -> None:
    """engine.speculativeConfig (vLLM's keys, here the suffix method's) is the scheduler's parsed SpeculativeConfig."""
    default = parse_container(render("default"), "scheduler", dict(pagoda_containers(render("default")))["scheduler"])
    assert default.speculative_config is None
    spec = {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_cached_requests": 100,
            "suffix_decoding_min_token_prob": 0.2}  # fmt: skip
    out = helm_template("--set-json", f"engine.speculativeConfig={json.dumps(spec)}")
    assert out.returncode == 0, out.stderr
    r = Rendered("suffix", [o for o in yaml.safe_load_all(out.stdout) if o])
    got = parse_container(r, "scheduler", dict(pagoda_containers(r))["scheduler"]).speculative_config
    assert got == SpeculativeConfig(**spec)
    too_likely = {"method": "suffix", "suffix_decoding_min_token_prob": 2}
    bad = helm_template("--set-json", f"engine.speculativeConfig={json.dumps(too_likely)}")
    assert "values don't meet the specifications of the schema" in bad.stderr, bad.stderr


def test_structured_outputs_compile_timeout_reaches_the_scheduler(render: Any) -> None:
    """engine.structuredOutputsCompileTimeout is the scheduler's grammar deadline; unset keeps its default; <= 0 is
    refused by the chart's schema."""
    default = parse_container(render("default"), "scheduler", dict(pagoda_containers(render("default")))["scheduler"])
    assert default.structured_outputs_compile_timeout == field_default("structured_outputs_compile_timeout")
    out = helm_template("--set-json", "engine.structuredOutputsCompileTimeout=2.5")
    assert out.returncode == 0, out.stderr
    r = Rendered("compile-timeout", [o for o in yaml.safe_load_all(out.stdout) if o])
    assert (
        parse_container(r, "scheduler", dict(pagoda_containers(r))["scheduler"]).structured_outputs_compile_timeout
        == 2.5
    )
    bad = helm_template("--set-json", "engine.structuredOutputsCompileTimeout=0")
    assert "values don't meet the specifications of the schema" in bad.stderr, bad.stderr


def test_chat_content_special_tokens_is_off_unless_set(render: Any) -> None:
    default = parse_container(render("default"), "frontend", dict(pagoda_containers(render("default")))["frontend"])
    assert default.chat_content_special_tokens is False
    out = helm_template("--set", "security.chatContentSpecialTokens=true")
    assert out.returncode == 0, out.stderr
    r = Rendered("trusted", [o for o in yaml.safe_load_all(out.stdout) if o])
    assert parse_container(r, "frontend", dict(pagoda_containers(r))["frontend"]).chat_content_special_tokens


def test_model_replicas_are_engine_pods_the_frontends_find_by_dns(render: Any) -> None:
    r: Rendered = render("replicas")
    engine = r.component("engine")
    assert engine["kind"] == "Deployment" and engine["spec"]["replicas"] == 2
    assert {w["metadata"]["labels"][COMPONENT] for w in r.workloads()} == {"frontend", "engine"}
    spec = pod_spec(engine)
    assert [c["name"] for c in spec["containers"]] == ["scheduler", "worker"]
    scheduler = parse_container(r, "scheduler", r.container("scheduler"))
    worker = parse_container(r, "worker", r.container("worker"))
    # The scheduler's one worker is its own pod's (its Service name is an alias of loopback there).
    ((host, port),) = [a.rsplit(":", 1) for a in scheduler.worker_addrs]
    assert int(port) == worker.port and spec["hostAliases"] == [{"ip": "127.0.0.1", "hostnames": [host]}]
    headless = r.get("Service", engine["metadata"]["name"])
    assert headless["spec"]["clusterIP"] == "None"
    frontend = parse_container(r, "frontend", r.container("frontend"))
    assert frontend.replicas.dns_host == f"{headless['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert frontend.replicas.dns_port == scheduler.port and frontend.routing_policy == "prefix"
    (pdb,) = [p for p in r.by_kind["PodDisruptionBudget"] if p["metadata"]["name"] == engine["metadata"]["name"]]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == engine["spec"]["selector"]["matchLabels"]
    (policy,) = [p for p in r.by_kind["NetworkPolicy"] if p["metadata"]["name"] == engine["metadata"]["name"]]
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert scheduler.port in admitted and worker.port not in admitted  # the worker: loopback only


def test_engine_autoscaling_scales_the_replicas_on_their_own_queue() -> None:
    out = helm_template(
        "-f", str(CHART / "ci" / "observability-values.yaml"), "--set", "modelReplicas.autoscaling.enabled=true"
    )
    assert out.returncode == 0, out.stderr
    objects = [o for o in yaml.safe_load_all(out.stdout) if o]
    engine = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-engine"))
    assert "replicas" not in engine["spec"]  # KEDA owns the count
    scaled = [
        o
        for o in objects
        if o["kind"] == "ScaledObject" and o["spec"]["scaleTargetRef"]["name"] == engine["metadata"]["name"]
    ]
    (trigger,) = scaled[0]["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    assert query.startswith("sum(pagoda:num_requests_waiting{")
    assert f'namespace="{NAMESPACE}"' in query and f'service="{engine["metadata"]["name"]}"' in query


def test_multi_rank_replicas_are_refused() -> None:
    out = helm_template("--set", "modelReplicas.count=2", "--set", "engine.tensorParallelSize=2")
    assert out.returncode != 0 and "engine.tensorParallelSize" in out.stderr
