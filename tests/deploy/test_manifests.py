"""deploy/: the Kubernetes manifests, checked without a cluster.

Core resources against Kubernetes' own OpenAPI schema (kubernetes-validate, strict: an
unknown field is an error); the InferencePool and llm-d's EndpointPickerConfig against
the JSON schemas in tests/deploy/schemas, written from their CRD / Go types (the picker's
from llm-d-router's source at the tag its image runs, named in the schema). Then the
cross-checks no schema can make: the ports, probe paths, metric names, module and
KV-event wiring in the YAML against what this repository really serves."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

_TEST_EXTRA = "not installed (pip install -e '.[test]')"
yaml = pytest.importorskip("yaml", reason=f"pyyaml {_TEST_EXTRA}")
jsonschema = pytest.importorskip("jsonschema", reason=f"jsonschema {_TEST_EXTRA}")
kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                          reason=f"kubernetes-validate {_TEST_EXTRA}")

from backend import metrics as engine_metrics  # noqa: E402
from backend import metric_families  # noqa: E402
from backend.model_json import parse_model_json  # noqa: E402
from backend.triton_server import ServerPorts, TritonServer  # noqa: E402
from engine.config import CacheConfig, EngineConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
SERVED_MODEL = "llm"
# What the Service, pool and sidecar command promise; the tests below tie each to its source.
OPENAI_PORT = 9000
SAMPLE_POD_IP = "10.244.1.17"
# Oldest Kubernetes the manifests are meant for (gRPC probes are GA since 1.27), and the
# newest the validator knows.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
# Measured (SmolLM2-135M, float32, this engine offline): process RSS 2.5 GiB with a
# 1 GiB KV pool, i.e. ~1.5 GiB besides the pool.
ENGINE_BYTES_BESIDES_KV_POOL = int(1.5 * 2**30)


def load_documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path, doc))
    return docs


DOCS = load_documents()


def resource(kind: str, name: str) -> dict:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r} under deploy/, found {len(found)}"
    return found[0]


def container(pod_spec: dict, name: str) -> dict:
    found = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"no container {name!r}"
    return found[0]


def port_of(cont: dict, name: str) -> int:
    return next(p["containerPort"] for p in cont["ports"] if p["name"] == name)


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    values += [args[i + 1] for i, a in enumerate(args[:-1]) if a == f"--{name}"]
    assert len(values) == 1, f"--{name} given {len(values)} times in {args}"
    return values[0]


MODEL_SERVER = resource("Deployment", "triton-llm-engine")
POD = MODEL_SERVER["spec"]["template"]
TRITON = container(POD["spec"], "triton")
FRONTEND = container(POD["spec"], "openai-frontend")
SERVICE = resource("Service", "triton-llm-engine")
POOL = resource("InferencePool", "triton-llm-engine")
EPP = resource("Deployment", "triton-llm-engine-epp")
EPP_CONTAINER = container(EPP["spec"]["template"]["spec"], "epp")
EPP_SERVICE = resource("Service", "triton-llm-engine-epp")
MODEL_JSON_MAP = resource("ConfigMap", "triton-llm-engine-model-json")


def epp_config() -> dict:
    config_map = resource("ConfigMap", "triton-llm-engine-epp-config")
    path = Path(flag(EPP_CONTAINER["args"], "config-file"))
    mount = next(m for m in EPP_CONTAINER["volumeMounts"] if m["name"] == "config")
    assert path.parent == Path(mount["mountPath"]), "--config-file is not in the mounted ConfigMap"
    volume = next(v for v in EPP["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    return yaml.safe_load(config_map["data"][path.name])


EPP_CONFIG = epp_config()


def plugin(config: dict, plugin_type: str) -> dict:
    found = [p for p in config["plugins"] if p["type"] == plugin_type]
    assert len(found) == 1, f"expected one {plugin_type} plugin"
    return found[0].get("parameters", {})


class Dockerfile:
    def __init__(self, path: Path) -> None:
        # Continuation lines joined, comments (also those inside a RUN) dropped.
        lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
        self.instructions = [(ins.split(None, 1) + [""])[:2]
                             for ins in "\n".join(lines).replace("\\\n", " ").splitlines() if ins.strip()]

    def all(self, name: str) -> list[str]:
        return [arg for ins, arg in self.instructions if ins.upper() == name]

    @property
    def workdir(self) -> str:
        return self.all("WORKDIR")[-1].strip()

    @property
    def cmd(self) -> list[str]:
        return json.loads(self.all("CMD")[-1])

    @property
    def exposed(self) -> set[int]:
        return {int(p.split("/")[0]) for arg in self.all("EXPOSE") for p in arg.split()}


DOCKERFILE = Dockerfile(REPO / "Dockerfile")


def render_model_json(tmp_path: Path, pod_ip: str = SAMPLE_POD_IP) -> dict:
    """Runs the init container's own command, its mount paths moved under tmp_path."""
    init = next(c for c in POD["spec"]["initContainers"] if c["name"] == "render-model-json")
    script = init["command"][-1]
    assert init["command"][:2] == ["sh", "-c"]
    volumes = {v["name"]: v for v in POD["spec"]["volumes"]}
    for mount in init["volumeMounts"]:
        local = tmp_path / mount["name"]
        local.mkdir()
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            assert volume["configMap"]["name"] == MODEL_JSON_MAP["metadata"]["name"]
            for key, text in MODEL_JSON_MAP["data"].items():
                (local / key).write_text(text)
        script = script.replace(mount["mountPath"], str(local))
    env = {"PATH": "/usr/bin:/bin", "POD_IP": pod_ip}
    subprocess.run(["sh", "-c", script], env=env, check=True, timeout=30)
    # The Triton container mounts the rendered file over the image's model.json.
    mount = next(m for m in TRITON["volumeMounts"] if m["name"] == "model-json")
    return json.loads((tmp_path / "model-json" / mount["subPath"]).read_text())


# --- every file parses, kustomize sees every file ---

def test_every_manifest_file_is_listed_by_its_kustomization():
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        folder = kustomization.parent
        listed = yaml.safe_load(kustomization.read_text())["resources"]
        for entry in listed:
            assert (folder / entry).exists(), f"{kustomization}: {entry} does not exist"
        files = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
        subfolders = {p.name for p in folder.iterdir() if (p / "kustomization.yaml").exists()}
        assert files | subfolders == set(listed), f"{kustomization} lists {listed}"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")
def test_kustomize_builds_every_document():
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    built = [d for d in yaml.safe_load_all(out) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == \
        sorted((d["kind"], d["metadata"]["name"]) for _, d in DOCS)
    images = {c["image"] for d in built if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"] + d["spec"]["template"]["spec"].get("initContainers", [])}
    assert all(":" in image for image in images), f"untagged image after kustomize: {images}"


# --- schemas ---

CORE = [(p, d) for p, d in DOCS if d["kind"] != "InferencePool"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path,doc", CORE, ids=[f"{d['kind']}/{d['metadata']['name']}" for _, d in CORE])
def test_core_resource_is_valid_kubernetes(path, doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_kubernetes_validation_is_not_vacuous():
    broken = json.loads(json.dumps(MODEL_SERVER))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def schema(name: str) -> jsonschema.protocols.Validator:
    loaded = json.loads((SCHEMAS / name).read_text())
    cls = jsonschema.validators.validator_for(loaded)
    cls.check_schema(loaded)
    return cls(loaded)


POOL_SCHEMA = schema("inferencepool-v1.schema.json")
EPP_SCHEMA = schema("endpointpickerconfig-v1alpha1.schema.json")


def test_inference_pool_matches_the_v1_crd():
    POOL_SCHEMA.validate(POOL)
    assert POOL["apiVersion"] == "inference.networking.k8s.io/v1"


@pytest.mark.parametrize("breakage", [
    lambda p: p["spec"].pop("targetPorts"),
    lambda p: p["spec"]["targetPorts"].append({"number": p["spec"]["targetPorts"][0]["number"]}),
    lambda p: p["spec"]["endpointPickerRef"].pop("port"),
    lambda p: p["spec"].update(appProtocol="grpc"),
    lambda p: p["spec"]["selector"].update(matchLabels={}),
    lambda p: p["spec"].update(targetPortNumber=9000),  # v1alpha2's field name
], ids=["no-targetPorts", "duplicate-port", "service-ref-without-port", "bad-appProtocol",
        "empty-selector", "v1alpha2-field"])
def test_inference_pool_schema_refuses_what_the_crd_refuses(breakage):
    broken = json.loads(json.dumps(POOL))
    breakage(broken)
    assert not POOL_SCHEMA.is_valid(broken)


# llm-d-router's source the picker's schema and flags were read from (x-source in each
# file names the tag, commit and Go files); epp.yaml must run that tag's image.
PICKER_SOURCE = EPP_SCHEMA.schema["x-source"]
PICKER_FLAGS = json.loads((SCHEMAS / "endpoint-picker-flags.json").read_text())


def test_epp_config_matches_the_endpoint_picker_config_type():
    EPP_SCHEMA.validate(EPP_CONFIG)
    # The current group; inference.networking.x-k8s.io is accepted only as deprecated.
    assert EPP_CONFIG["apiVersion"] == "llm-d.ai/v1alpha1"


def test_picker_image_is_the_release_the_schema_was_read_from():
    assert PICKER_SOURCE["repository"] == "llm-d/llm-d-router"
    assert PICKER_SOURCE["tag"] == "v0.9.0" == PICKER_FLAGS["x-source"]["tag"]
    assert "apix/config/v1alpha1/endpointpickerconfig_types.go" in PICKER_SOURCE["files"]
    image, tag = EPP_CONTAINER["image"].rsplit(":", 1)
    assert image == "ghcr.io/llm-d/llm-d-router-endpoint-picker"
    assert tag == PICKER_SOURCE["tag"], "the picker image is not the release the schema pins"
    readme = (REPO / "README.md").read_text()
    assert f"llm-d-router {PICKER_SOURCE['tag']}" in readme
    for cont in EPP["spec"]["template"]["spec"]["containers"]:
        assert not cont["image"].endswith((":dev", ":latest", ":main")), cont["image"]


def test_picker_flags_exist_at_the_pinned_tag():
    names = [a[2:].split("=", 1)[0] for a in EPP_CONTAINER["args"] if a.startswith("--")]
    unknown = set(names) - set(PICKER_FLAGS["flags"])
    assert not unknown, f"flags the picker at {PICKER_SOURCE['tag']} does not register: {unknown}"
    assert not set(names) & set(PICKER_FLAGS["refused"])
    # The one deprecated flag kept: at this tag metrics-data-source has no port to say
    # where the metrics are instead.
    assert set(names) & set(PICKER_FLAGS["deprecated"]) == {"model-server-metrics-port"}
    assert "port" not in EPP_SCHEMA.schema["$defs"]["metricsDatasourceParams"]["properties"]


def _plugin_entry(config: dict, plugin_type: str) -> dict:
    return next(p for p in config["plugins"] if p["type"] == plugin_type)


@pytest.mark.parametrize("breakage", [
    lambda c: c.pop("schedulingProfiles"),
    lambda c: c["plugins"].append({"name": "no-type"}),
    lambda c: c.update(profiles=[]),
    lambda c: plugin(c, "precise-prefix-cache-producer")["kvEventsConfig"].update(socketPort=5557),
    lambda c: plugin(c, "core-metrics-extractor")["engineConfigs"][0].update(kvCacheUsageSpec="x"),
    # The spelling before May 2026, refused since the rename to vllm.url.
    lambda c: plugin(c, "token-producer").update(vllm={"http": "http://localhost:8200"}),
    lambda c: plugin(c, "token-producer").pop("modelName"),
    lambda c: plugin(c, "token-producer").update(estimate={}),
    # No port parameter on the metrics source at this tag.
    lambda c: plugin(c, "metrics-data-source").update(port=8002),
    lambda c: plugin(c, "precise-prefix-cache-producer")["indexerConfig"].update(
        tokenizersPoolConfig={}),
    lambda c: plugin(c, "prefix-cache-scorer").update(producerName="x"),
    lambda c: plugin(c, "precise-prefix-cache-producer")["tokenProcessorConfig"].update(
        blockSizeTokens="16"),
], ids=["no-profiles", "plugin-without-type", "unknown-top-level-field",
        "socketPort-outside-podDiscoveryConfig", "misspelt-metric-key", "vllm-http-key",
        "vllm-without-modelName", "two-tokenizer-backends", "metrics-port-parameter",
        "tokenizers-pool-in-producer", "unknown-scorer-parameter", "string-for-int"])
def test_epp_schema_refuses_what_the_picker_refuses(breakage):
    broken = json.loads(json.dumps(EPP_CONFIG))
    breakage(broken)
    assert not EPP_SCHEMA.is_valid(broken)


def test_epp_schema_leaves_ignored_parameters_open():
    # Factories declared `_ *json.Decoder` never read their parameters.
    config = json.loads(json.dumps(EPP_CONFIG))
    _plugin_entry(config, "queue-scorer")["parameters"] = {"anything": 1}
    EPP_SCHEMA.validate(config)


def test_epp_schema_accepts_the_picker_repositorys_own_examples():
    """The sample configs in llm-d-router's deploy/config at the pinned tag, read from a
    clone of it (LLM_D_ROUTER_GIT: its git directory), pass the schema."""
    git_dir = os.environ.get("LLM_D_ROUTER_GIT")
    if not git_dir:
        pytest.skip("LLM_D_ROUTER_GIT (a clone of llm-d-router) not set")
    tag = PICKER_SOURCE["tag"]

    def git(*args: str) -> str:
        return subprocess.run(["git", "--git-dir", git_dir, *args], check=True,
                              capture_output=True, text=True, timeout=60).stdout

    assert git("rev-parse", f"{tag}^{{commit}}").strip() == PICKER_SOURCE["commit"]
    names = [n for n in git("ls-tree", "--name-only", f"{tag}:deploy/config").split()
             if n.endswith(".yaml")]
    assert names
    refused = {}
    for name in names:
        for doc in yaml.safe_load_all(git("show", f"{tag}:deploy/config/{name}")):
            if doc and doc.get("kind") == "EndpointPickerConfig":
                refused.update({name: {key for e in EPP_SCHEMA.iter_errors(doc)
                                       for key in re.findall(r"'(\w+)' was unexpected", e.message)
                                       or [e.message]}})
    # One sample at the tag is stale: llm-d-kv-cache's indexer config lost
    # tokenProcessorConfig after v0.7 and never had maxPrefixBlocksToMatch, so the
    # producer's strict decoder refuses it as this schema does.
    stale = {"sim-epp-no-hit-lru.yaml": {"tokenProcessorConfig", "maxPrefixBlocksToMatch"}}
    assert {n: keys for n, keys in refused.items() if keys} == stale


def test_epp_config_references_resolve():
    names = [p.get("name") or p["type"] for p in EPP_CONFIG["plugins"]]
    assert len(names) == len(set(names)), "plugin names must be unique"
    refs = [p["pluginRef"] for prof in EPP_CONFIG["schedulingProfiles"] for p in prof["plugins"]]
    for source in EPP_CONFIG.get("dataLayer", {}).get("sources", []):
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    assert set(refs) <= set(names), f"unknown pluginRef: {set(refs) - set(names)}"


# --- ports and probes against what the server serves ---

def test_triton_container_ports_are_the_server_defaults():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import serve
        defaults = serve.parse_args([])
    finally:
        sys.path.remove(str(REPO / "scripts"))
    ports = ServerPorts()
    assert (ports.http, ports.grpc, ports.metrics) == (defaults.http_port, defaults.grpc_port,
                                                       defaults.metrics_port)
    assert port_of(TRITON, "http") == ports.http
    assert port_of(TRITON, "grpc") == ports.grpc
    assert port_of(TRITON, "metrics") == ports.metrics
    # Triton's own defaults are those ports, so the pod must not move them.
    assert not [a for a in TRITON["args"] if re.match(r"--(http|grpc|metrics)-port", a)]


def _path_requested(call) -> str:
    seen = []

    class Response:
        status = status_code = 200

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake(url, *args, **kwargs):
        seen.append(url if isinstance(url, str) else url.full_url)
        return Response()

    call(fake)
    assert len(seen) == 1
    return "/" + seen[0].split("://", 1)[-1].split("/", 1)[1]


def test_probe_paths_are_triton_health_endpoints(monkeypatch):
    def readiness(fake):
        monkeypatch.setattr(urllib.request, "urlopen", fake)
        assert TritonServer(Path("."), ServerPorts()).is_ready()

    def liveness(fake):
        from tritonclient.http import InferenceServerClient
        client = InferenceServerClient("localhost:8000")
        monkeypatch.setattr(client, "_get", lambda request_uri, **kw: fake("http://h/" + request_uri))
        assert client.is_server_live()

    ready_path = _path_requested(readiness)  # what serve.py and the e2e tests wait for
    live_path = _path_requested(liveness)    # Triton's KServe v2 liveness route
    assert (ready_path, live_path) == ("/v2/health/ready", "/v2/health/live")
    for probe in ("startupProbe", "readinessProbe"):
        assert TRITON[probe]["httpGet"] == {"path": ready_path, "port": "http"}
    assert TRITON["livenessProbe"]["httpGet"] == {"path": live_path, "port": "http"}


def test_prometheus_scrapes_the_metrics_port():
    annotations = POD["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port_of(TRITON, "metrics") == ServerPorts().metrics
    assert annotations["prometheus.io/path"] == "/metrics"
    assert TritonServer(Path("."), ServerPorts()).metrics_url.endswith(":8002/metrics")


def test_dockerfile_exposes_what_the_service_and_pod_serve():
    service_ports = {p["port"] for p in SERVICE["spec"]["ports"]}
    pod_ports = {p["containerPort"] for c in POD["spec"]["containers"] for p in c.get("ports", [])}
    assert DOCKERFILE.exposed == service_ports == pod_ports
    names = {p["name"]: p["containerPort"] for c in POD["spec"]["containers"] for p in c["ports"]}
    for port in SERVICE["spec"]["ports"]:
        assert names[port["targetPort"]] == port["port"], f"Service port {port['name']} targets elsewhere"


def test_pod_runs_the_image_cmd_and_stops_within_the_grace_period():
    cmd = DOCKERFILE.cmd
    assert TRITON["args"][:len(cmd)] == cmd, "the pod's tritonserver flags drifted from the image's CMD"
    assert flag(cmd, "model-repository") == f"{DOCKERFILE.workdir}/model_repository"
    assert flag(TRITON["args"], "load-model") == SERVED_MODEL
    exit_timeout = int(flag(cmd, "exit-timeout-secs"))
    for cont in (TRITON, FRONTEND):
        pre_stop = cont["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        assert int(pre_stop[1]) + exit_timeout < POD["spec"]["terminationGracePeriodSeconds"]


def test_selectors_pick_the_model_server_pods():
    labels = POD["metadata"]["labels"]
    for selector in (MODEL_SERVER["spec"]["selector"]["matchLabels"], SERVICE["spec"]["selector"],
                     POOL["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    epp_labels = EPP["spec"]["template"]["metadata"]["labels"]
    assert EPP_SERVICE["spec"]["selector"].items() <= epp_labels.items()
    assert not EPP_SERVICE["spec"]["selector"].items() <= labels.items()


def test_pool_points_at_the_openai_port_and_the_picker():
    assert [p["number"] for p in POOL["spec"]["targetPorts"]] == [port_of(FRONTEND, "openai")] == [OPENAI_PORT]
    ref = POOL["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref["name"] == EPP_SERVICE["metadata"]["name"]
    service_port = next(p for p in EPP_SERVICE["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert port_of(EPP_CONTAINER, service_port["targetPort"]) == ref["port"]["number"]
    assert flag(EPP_CONTAINER["args"], "pool-name") == POOL["metadata"]["name"]
    assert flag(EPP_CONTAINER["args"], "pool-group") == POOL["apiVersion"].split("/")[0]


# --- the OpenAI sidecar ---

def test_openai_sidecar_command_and_port():
    expected = ["python3", "-m", "openai_frontend", "--triton-grpc", f"localhost:{ServerPorts().grpc}",
                "--model", SERVED_MODEL, "--port", str(OPENAI_PORT)]
    assert FRONTEND["command"] == expected
    assert FRONTEND["image"] == TRITON["image"]
    assert port_of(FRONTEND, "openai") == OPENAI_PORT
    assert FRONTEND["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
    # `python3 -m` finds the package from the working folder: the image's source tree.
    assert FRONTEND["workingDir"] == DOCKERFILE.workdir
    assert DOCKERFILE.all("COPY")[0].split() == [".", "./"]
    ignored = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    assert not [p for p in ignored if p.rstrip("/") in ("openai_frontend", "*", "**")]


def test_openai_frontend_module_takes_the_sidecar_flags():
    assert importlib.util.find_spec("openai_frontend.__main__") is not None
    out = subprocess.run([sys.executable, "-m", "openai_frontend", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for option in FRONTEND["command"][3::2]:
        assert option in out.stdout, f"openai_frontend --help does not mention {option}"


# --- both keys from one Secret (docs/security.md) ---

KEYS_SECRET = "triton-llm-engine-keys"


def secret_env(cont: dict) -> dict[str, dict]:
    """name -> secretKeyRef of the container's env entries taken from a Secret."""
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in cont.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


def test_tritons_admin_apis_are_keyed_from_the_secret():
    from backend.restricted_api import ENV_VAR, tritonserver_flags

    # Not optional: without the Secret the pod waits instead of serving the APIs open.
    assert secret_env(TRITON) == {ENV_VAR: {"name": KEYS_SECRET, "key": "admin-key"}}
    literal = {e["name"]: e["value"] for e in TRITON["env"] if "value" in e}
    # Kubernetes' $(VAR) expansion of args, the Secret's value left as its reference.
    args = [re.sub(r"\$\((\w+)\)", lambda m: literal.get(m[1], m[0]), a) for a in TRITON["args"]]
    restricted = [a for a in args if a.startswith(("--http-restricted", "--grpc-restricted"))]
    assert restricted == tritonserver_flags(f"$({ENV_VAR})")


def test_openai_sidecar_takes_its_api_key_and_tritons_admin_key_from_the_secret():
    from backend.restricted_api import ENV_VAR as ADMIN_ENV
    from openai_frontend.__main__ import frontend_options, parse_args
    from openai_frontend.auth import ENV_VAR as API_KEY_ENV

    assert secret_env(FRONTEND) == {API_KEY_ENV: {"name": KEYS_SECRET, "key": "api-key"},
                                    ADMIN_ENV: {"name": KEYS_SECRET, "key": "admin-key"}}
    # The sidecar's own command line reads them from those variables.
    environ = {API_KEY_ENV: "client-key", ADMIN_ENV: "admin-key-0123456789"}
    options = frontend_options(parse_args(FRONTEND["command"][3:]), environ)
    assert options.api_keys == ("client-key",)
    assert options.triton_admin_key == "admin-key-0123456789"


# --- metrics the picker reads ---

def test_picker_reads_metrics_the_engine_exports():
    extractor = plugin(EPP_CONFIG, "core-metrics-extractor")
    engine_type = POD["metadata"]["labels"][extractor["engineLabelKey"]]
    (config,) = [e for e in extractor["engineConfigs"] if e["name"] == engine_type]
    exported = ({f.name for f in metric_families.FAMILIES if f.kind == metric_families.GAUGE}
                | {metric_families.CACHE_CONFIG_INFO.name})
    expected = {"queuedRequestsSpec": "vllm:num_requests_waiting",
                "runningRequestsSpec": "vllm:num_requests_running",
                "kvUsageSpec": "vllm:kv_cache_usage_perc",
                "cacheInfoSpec": "vllm:cache_config_info"}
    for key, name in expected.items():
        match = re.fullmatch(r"([a-z_:]+)(?:\{model=(\w+)\})?", config[key])
        assert match, config[key]
        assert match[1] == name and name in exported
        # Triton labels each metric with its model: the filter must be the served one.
        assert match[2] in (None, SERVED_MODEL)
    assert config["loraSpec"] == ""  # the engine exports no LoRA metric
    # The picker reads the KV capacity from these labels by default.
    labels = exported_cache_info_labels()
    assert {"block_size", "num_gpu_blocks"} <= labels.keys()
    assert labels["model"] == SERVED_MODEL


def exported_cache_info_labels() -> dict[str, str]:
    """The labels backend/metrics.py gives vllm:cache_config_info, through a stand-in
    for Triton's pb_utils.MetricFamily."""
    families = {}

    class MetricFamily:
        GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, **kwargs):
            families[self.name] = labels
            return type("Metric", (), {"set": lambda *a: None})()

    stub = type(sys)("triton_python_backend_utils")
    stub.MetricFamily = MetricFamily
    saved = sys.modules.get(stub.__name__)
    sys.modules[stub.__name__] = stub
    try:
        engine_metrics.TritonMetrics(SERVED_MODEL, "1").engine_ready(16, 1000, 1024)
    finally:
        if saved is None:
            del sys.modules[stub.__name__]
        else:
            sys.modules[stub.__name__] = saved
    return families[metric_families.CACHE_CONFIG_INFO.name]


def test_picker_scrapes_triton_metrics_port_not_the_target_port():
    # At v0.9.0 the flag is how (test_picker_flags_exist_at_the_pinned_tag).
    assert int(flag(EPP_CONTAINER["args"], "model-server-metrics-port")) == port_of(TRITON, "metrics")
    # The picker honours that flag only for single-port pools.
    assert len(POOL["spec"]["targetPorts"]) == 1
    assert plugin(EPP_CONFIG, "metrics-data-source")["path"] == POD["metadata"]["annotations"]["prometheus.io/path"]


# --- KV-cache events ---

def test_model_json_publishes_kv_events_where_the_picker_listens(tmp_path):
    rendered = render_model_json(tmp_path)
    events = rendered["kv_events_config"]
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    assert rendered["prefix_caching_hash_algo"] == "sha256_cbor"

    def bound_port(endpoint: str) -> int:
        match = re.fullmatch(r"tcp://\*:(\d+)", endpoint)
        assert match, f"{endpoint}: the engine must bind on all interfaces"
        return int(match[1])

    assert bound_port(events["endpoint"]) == port_of(TRITON, "kv-events")
    assert bound_port(events["replay_endpoint"]) == port_of(TRITON, "kv-replay")

    scorer = plugin(EPP_CONFIG, "precise-prefix-cache-producer")
    kv = scorer["kvEventsConfig"]
    assert kv["discoverPods"] is True and "zmqEndpoint" not in kv
    assert kv["podDiscoveryConfig"]["socketPort"] == bound_port(events["endpoint"])
    # llm-d's vLLM adapter reads kv@<pod>@<model>; <pod> must be the address it scores
    # (pod IP : pool target port) and <model> the model clients name.
    assert events["topic"].startswith(kv["topicFilter"])
    assert events["topic"] == f"kv@{SAMPLE_POD_IP}:{POOL['spec']['targetPorts'][0]['number']}@{SERVED_MODEL}"
    block_size = rendered.get("block_size", CacheConfig().block_size)
    assert scorer["tokenProcessorConfig"]["blockSizeTokens"] == block_size
    # The scorer reads what that producer finds.
    assert plugin(EPP_CONFIG, "prefix-cache-scorer")["prefixMatchInfoProducerName"] == \
        _plugin_entry(EPP_CONFIG, "precise-prefix-cache-producer").get("name",
                                                                      "precise-prefix-cache-producer")


def test_rendered_model_json_replaces_the_images_copy(tmp_path):
    mount = next(m for m in TRITON["volumeMounts"] if m["name"] == "model-json")
    repository = flag(DOCKERFILE.cmd, "model-repository")
    assert mount["mountPath"] == f"{repository}/{SERVED_MODEL}/1/model.json"
    assert (REPO / "model_repository" / SERVED_MODEL / "1" / "model.json").is_file()
    # Every pod gets its own address.
    (tmp_path / "other").mkdir()
    other = render_model_json(tmp_path / "other", "10.0.0.9")
    assert "10.0.0.9:" in other["kv_events_config"]["topic"]
    assert "${" not in json.dumps(other)


def test_model_json_is_accepted_by_the_backend(tmp_path):
    rendered = render_model_json(tmp_path)
    parsed = parse_model_json(rendered)
    assert parsed.engine_args["block_size"] == 16
    assert parsed.engine_args["max_num_seqs"] == 64
    # The whole engine configuration builds, KV events included.
    config = EngineConfig.from_dict(parsed.engine_args)
    assert config.kv_events_config.active and config.kv_events_config.endpoint == "tcp://*:5557"
    assert config.cache.prefix_caching_hash_algo == "sha256_cbor"


def test_two_instances_with_the_deploys_kv_event_ports_both_open_their_sockets(tmp_path):
    """instance_group count 2 with this model.json: rank 1 publishes on the ports + 1
    (vLLM's data-parallel rule), which must not be rank 0's. Both ranks pass the
    cross-rank check (so do far more), then both really bind, on the deploy's spacing
    moved to ports free on this host."""
    import dataclasses
    import socket

    from backend.instance import place_instance
    from engine.core.kv_cache.publisher import make_publisher

    config = EngineConfig.from_dict(parse_model_json(render_model_json(tmp_path)).engine_args)
    events = config.kv_events_config
    for rank in range(16):
        events.for_rank(rank)
    ranks = [place_instance(config, {"model_instance_name": f"llm_0_{i}",
                                     "model_instance_kind": "CPU"}) for i in range(2)]
    assert [r.data_parallel_rank for r in ranks] == [0, 1]
    pub = int(events.endpoint.rsplit(":", 1)[1])
    gap = int(events.replay_endpoint.rsplit(":", 1)[1]) - pub

    def free(port):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                return False
        return True
    base = next(b for b in range(20000, 40000, 7)
                if all(free(p) for p in (b, b + 1, b + gap, b + gap + 1)))
    moved = dataclasses.replace(events, endpoint=f"tcp://*:{base}",
                                replay_endpoint=f"tcp://*:{base + gap}")
    publishers = []
    try:
        for rank in range(2):
            publishers.append(make_publisher(moved, rank))
        assert all(p.enabled for p in publishers)
    finally:
        for p in publishers:
            p.shutdown()


def test_memory_request_covers_the_kv_pool(tmp_path):
    rendered = render_model_json(tmp_path)
    request = TRITON["resources"]["requests"]["memory"]
    assert request.endswith("Gi")
    assert int(request[:-2]) * 2**30 >= rendered["kv_cache_memory_bytes"] + ENGINE_BYTES_BESIDES_KV_POOL


def test_token_producer_uses_the_render_sidecar():
    producer = plugin(EPP_CONFIG, "token-producer")
    render = container(EPP["spec"]["template"]["spec"], "vllm-render")
    port = int(producer["vllm"]["url"].rsplit(":", 1)[1])
    assert port == port_of(render, "render")
    assert f"--port={port}" in render["args"]
    assert producer["modelName"] in render["args"]
    assert shlex.join(render["command"]) == "vllm launch render"
