"""PDService spec defaults (kept equal to the CRD's) and the validation the schema cannot do."""

import pathlib
import re

import pytest
import yaml

from pdserve.operator.spec import problems, with_defaults
from tests.operator.helpers import spec
from tests.operator.kmock_emulator import apply_defaults

CRD = pathlib.Path(__file__).resolve().parents[2] / "helm/pdserve/crds/pdservices.pdserve.io.yaml"


def spec_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


@pytest.mark.parametrize(
    "fields",
    [{}, {"prefill": {"replicas": 3}, "kvTransfer": {"backend": "tcp"}}, {"kvTransfer": {"secretName": "kv"}}],
)
def test_defaults_are_the_crds(fields):
    expected = spec(**fields)
    apply_defaults(spec_schema(), expected)
    assert with_defaults(spec(**fields)) == expected


def test_defaults_leave_the_argument_alone():
    original = spec()
    with_defaults(original)
    assert original == spec()


def test_a_valid_spec_has_no_problems():
    assert problems("llm", spec()) == []
    assert problems("llm", spec(model={"source": "huggingface", "repo": "Qwen/Qwen3-0.6B"})) == []
    assert problems("llm", spec(model={"source": "hostPath", "hostPath": "/data/m", "path": "qwen/v1"})) == []
    assert problems("llm", spec(prefill={"engineArgs": ["--max-model-len", "8192", "--kv-events-port=0"]})) == []
    assert problems("llm", spec(kvTransfer={"secretName": "team-kv.v2"})) == []


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"model": {"source": "pvc"}}, "spec.model.claimName is required"),
        ({"model": {"source": "hostPath"}}, "spec.model.hostPath is required"),
        ({"model": {"source": "hostPath", "hostPath": "data"}}, "absolute path"),
        ({"model": {"source": "huggingface"}}, "spec.model.repo is required"),
        ({"model": {"source": "pvc", "claimName": "m", "path": "../etc"}}, "spec.model.path"),
        ({"model": {"source": "s3"}}, "spec.model.source must be one of"),
        ({"image": ""}, "spec.image is required"),
        ({"prefill": {"engineArgs": ["--port", "9000"]}}, "spec.prefill.engineArgs must not set --port"),
        ({"decode": {"engineArgs": ["--model=/x"]}}, "must not set --model"),
        ({"decode": {"engineArgs": ["--mod", "/x"]}}, "must not set --model"),  # argparse prefix
        ({"decode": {"engineArgs": ["--kv-lease-seconds", "5"]}}, "must not set --kv-lease-seconds"),
        ({"decode": {"engineArgs": "--port 1"}}, "must be a list of strings"),
        ({"prefill": {"engineArgs": ["--kv-secret-file", "/x"]}}, "must not set --kv-secret-file"),
        ({"decode": {"engineArgs": ["--kv-insecure"]}}, "must not set --kv-insecure"),
        ({"router": {"args": ["--kv-secret-file=/x"]}}, "spec.router.args must not set --kv-secret-file"),
        ({"router": {"args": ["--kv-insecure"]}}, "spec.router.args must not set --kv-insecure"),
        ({"router": {"args": ["--selector", "x=y"]}}, "spec.router.args must not set --selector"),
        ({"router": {"replicas": -1}}, "spec.router.replicas must be an integer >= 0"),
        ({"prefill": {"gpus": True}}, "spec.prefill.gpus must be an integer >= 0"),
        ({"prefill": {"resources": {"limits": {"nvidia.com/gpu": "2"}}}}, "set the pool's gpus"),
        ({"prefill": {"resources": {"cpu": "1"}}}, "ResourceRequirements"),
        ({"prefill": {"nodeSelector": {"a": 1}}}, "nodeSelector"),
        ({"kvTransfer": {"leaseSeconds": 0}}, "spec.kvTransfer.leaseSeconds must be a number >= 1"),
        ({"kvTransfer": {"backend": "rdma"}}, "spec.kvTransfer.backend"),
        ({"decode": "big"}, "spec.decode must be an object"),
    ],
)
def test_problems_name_the_field(fields, fragment):
    found = problems("llm", spec(**fields))
    assert any(fragment in problem for problem in found), found


SECRET_NAMES = [
    ("kv", True),
    ("team-kv.v2", True),
    ("0kv", True),
    ("a" * 253, True),
    ("a" * 254, False),
    ("", False),
    ("Team-KV", False),
    ("kv_secret", False),
    ("-kv", False),
    ("kv.", False),
    ("kv..v2", False),
]


@pytest.mark.parametrize(("name", "valid"), SECRET_NAMES)
def test_secret_names_must_be_dns_subdomains_in_the_crd_and_the_operator(name, valid):
    found = problems("llm", spec(kvTransfer={"secretName": name}))
    assert (found == []) is valid, found
    if not valid:
        assert "spec.kvTransfer.secretName must be a Secret's name" in found[0]
    schema = spec_schema()["properties"]["kvTransfer"]["properties"]["secretName"]
    assert (re.search(schema["pattern"], name) is not None and len(name) <= schema["maxLength"]) is valid


def test_a_secret_name_must_be_a_string():
    assert "spec.kvTransfer.secretName" in problems("llm", spec(kvTransfer={"secretName": 5}))[0]


@pytest.mark.parametrize("name", ["Llm", "llm.v1", "1llm", "x" * 56])
def test_names_that_cannot_name_services(name):
    assert "DNS-1035" in problems(name, spec())[0]
