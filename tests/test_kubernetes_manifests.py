"""deploy/kubernetes/: every manifest is valid against Kubernetes 1.37's schema (kubernetes-validate,
strict: unknown fields fail; its schemas ship in the package, so this runs offline), and the pieces
agree with each other and with the server they run (its flags, ports and probe route)."""

import copy
import importlib
import os
import re

import kubernetes_validate
import pytest
import yaml

KUBERNETES_VERSION = "1.37.0"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "kubernetes")
MANIFESTS = sorted(f for f in os.listdir(ROOT) if f.endswith(".yaml"))


def _load(name: str) -> list[dict]:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def _one(name: str) -> dict:
    (doc,) = _load(name)
    return doc


def _validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_manifests_are_there():
    assert {"deployment.yaml", "service.yaml", "hpa.yaml", "model-pvc.yaml",
            "prometheus-adapter-rules.yaml"} <= set(MANIFESTS)


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_is_valid_kubernetes(name):
    for doc in _load(name):
        _validate(doc)


def test_the_validator_rejects_what_kubernetes_would():
    """The check above can fail: a misspelt field and a wrong type are both refused."""
    deployment = _one("deployment.yaml")
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(misspelt)
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(wrong_type)


def test_the_pieces_fit_together():
    deployment, service, hpa = _one("deployment.yaml"), _one("service.yaml"), _one("hpa.yaml")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)

    # The container runs the launcher (what scripts/serve.py runs) with flags its parser accepts, on
    # the ports the pod declares.
    python, dash_m, module = container["command"]
    assert (python, dash_m) == ("python", "-m")
    launcher = importlib.import_module(module)
    assert callable(launcher.main)
    args = launcher.build_parser().parse_args(container["args"])
    assert args.enable_restful_api and args.host == "0.0.0.0"
    assert (args.restful_api_port, args.port) == (ports["http"], ports["grpc"])
    # The grace period covers the preStop pause and the drain, so Kubernetes never kills a pod mid-drain.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + args.drain_timeout
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pod["spec"]["terminationGracePeriodSeconds"]
    mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert args.model == mount["model"]

    # Probes on the public /health route of the HTTP port; Prometheus scrapes that port's /metrics.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    annotations = pod["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(ports["http"]),
                           "prometheus.io/path": "/metrics"}

    # The HPA scales this Deployment on the metric the adapter rule serves.
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    rules = yaml.safe_load(_one("prometheus-adapter-rules.yaml")["data"]["config.yaml"])["rules"]
    (rule,) = rules
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]

    # The pod volume is the claim model-pvc.yaml makes.
    claim = {v["name"]: v for v in pod["spec"]["volumes"]}["model"]["persistentVolumeClaim"]["claimName"]
    assert claim == _one("model-pvc.yaml")["metadata"]["name"]


def test_the_readme_variants_are_valid():
    """README.md's alternatives (the model from an image volume) applied to deployment.yaml still validate."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", readme, re.S)]
    volumes = [b["volumes"] for b in blocks if isinstance(b, dict) and "volumes" in b]
    assert volumes, "README.md shows the image-volume variant"
    for variant in volumes:
        deployment = _one("deployment.yaml")
        deployment["spec"]["template"]["spec"]["volumes"] = variant
        _validate(deployment)
