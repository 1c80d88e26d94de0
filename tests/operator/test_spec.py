"""PDService spec defaults (kept equal to the CRD's) and the validation the schema cannot do."""

import pathlib
import re

import pytest
import yaml

from pdserve.operator.spec import duration_seconds, problems, quantity_bytes, with_defaults
from tests.operator.helpers import spec
from tests.operator.kmock_emulator import apply_defaults

CRD = pathlib.Path(__file__).resolve().parents[2] / "helm/pdserve/crds/pdservices.pdserve.io.yaml"


def spec_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"prefill": {"replicas": 3}, "kvTransfer": {"backend": "tcp"}},
        {"kvTransfer": {"secretName": "kv"}},
        {"decode": {"tensorParallelSize": 4}},
        {"apiKeySecret": {"name": "team-api"}},
        {"prefill": {"kvCache": {"disk": {"size": "1Gi"}, "shared": {"claimName": "kv", "size": "2Gi"}}}},
        {"decode": {"kvCache": {"shared": {"claimName": "kv", "readOnly": True}}}},
    ],
)
def test_defaults_are_the_crds(fields):
    expected = spec(**fields)
    apply_defaults(spec_schema(), expected)
    # The defaults the CRD cannot hold: gpus follows the pool's tensorParallelSize, and the model's
    # path "" (an empty-string default makes Kubernetes 1.20 refuse the CRD).
    for role in ("prefill", "decode"):
        assert "default" not in spec_schema()["properties"][role]["properties"]["gpus"]
        expected[role]["gpus"] = expected[role]["tensorParallelSize"]
    assert "default" not in spec_schema()["properties"]["model"]["properties"]["path"]
    expected["model"].setdefault("path", "")
    assert with_defaults(spec(**fields)) == expected


def test_gpus_default_to_the_tensor_parallel_size():
    full = with_defaults(spec(prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 4, "gpus": 8}))
    assert (full["prefill"]["tensorParallelSize"], full["prefill"]["gpus"]) == (2, 2)
    assert (full["decode"]["tensorParallelSize"], full["decode"]["gpus"]) == (4, 8)  # a value given stays
    assert with_defaults(spec())["prefill"]["gpus"] == 1  # tensorParallelSize 1: one GPU, as before
    # An unusable size is reported by problems(); the default then stays the plain 1.
    assert with_defaults(spec(decode={"tensorParallelSize": "4"}))["decode"]["gpus"] == 1


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
    assert problems("llm", spec(prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 4})) == []
    assert problems("llm", spec(decode={"tensorParallelSize": 4, "gpus": 8, "shmSize": "512Mi"})) == []
    # CPU pods run their ranks as processes: any size goes with gpus 0.
    assert problems("llm", spec(prefill={"tensorParallelSize": 4, "gpus": 0})) == []
    assert problems("llm", spec(decode={"tensorParallelSize": 64, "gpus": 64})) == []
    tiers = {"hostMemory": "8Gi", "disk": {"size": "50Gi"}, "shared": {"claimName": "kv", "size": "1Ti"}}
    assert problems("llm", spec(prefill={"kvCache": {**tiers, "maxAge": "12h"}})) == []
    assert problems("llm", spec(decode={"kvCache": {"shared": {"claimName": "kv.v2", "readOnly": True}}})) == []
    assert problems("llm", spec(decode={"gpus": 0, "kvCache": {"disk": {"size": "1Gi"}, "maxAge": 3600}})) == []
    assert problems("llm", spec(prefill={"kvCache": {}})) == []  # no tier: nothing to check


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
        ({"prefill": {"engineArgs": ["--kv-keys", "/x"]}}, "must not set --kv-keys"),
        ({"prefill": {"engineArgs": ["--kv-nixl-unbounded"]}}, "must not set --kv-nixl-unbounded"),
        ({"decode": {"engineArgs": ["--kv-insecure"]}}, "must not set --kv-insecure"),
        ({"router": {"args": ["--kv-keys=/x"]}}, "spec.router.args must not set --kv-keys"),
        ({"router": {"args": ["--kv-insecure"]}}, "spec.router.args must not set --kv-insecure"),
        ({"router": {"args": ["--selector", "x=y"]}}, "spec.router.args must not set --selector"),
        (
            {"endpointPicker": {"args": ["--inference-pool=x"]}},
            "spec.endpointPicker.args must not set --inference-pool",
        ),
        ({"router": {"replicas": -1}}, "spec.router.replicas must be an integer >= 0"),
        ({"prefill": {"gpus": True}}, "spec.prefill.gpus must be an integer >= 0"),
        ({"prefill": {"resources": {"limits": {"nvidia.com/gpu": "2"}}}}, "set the pool's gpus"),
        ({"prefill": {"resources": {"cpu": "1"}}}, "ResourceRequirements"),
        ({"prefill": {"nodeSelector": {"a": 1}}}, "nodeSelector"),
        ({"kvTransfer": {"leaseSeconds": 0}}, "spec.kvTransfer.leaseSeconds must be a number >= 1"),
        ({"kvTransfer": {"backend": "rdma"}}, "spec.kvTransfer.backend"),
        ({"decode": "big"}, "spec.decode must be an object"),
        ({"decode": {"engineArgs": ["--tensor-parallel-size", "2"]}}, "must not set --tensor-parallel-size"),
        ({"decode": {"engineArgs": ["--tensor-parallel-size=2"]}}, "must not set --tensor-parallel-size"),
        ({"prefill": {"engineArgs": ["--tensor", "2"]}}, "must not set --tensor-parallel-size"),  # argparse prefix
        ({"prefill": {"engineArgs": ["-tp", "2"]}}, "spec.prefill.engineArgs must not set -tp"),
        ({"prefill": {"engineArgs": ["-tp=2"]}}, "must not set -tp"),
        ({"prefill": {"engineArgs": ["-t", "2"]}}, "must not set -tp"),  # argparse prefix of -tp
        ({"decode": {"engineArgs": ["--distributed-executor-backend", "mp"]}}, "--distributed-executor-backend"),
        ({"decode": {"engineArgs": ["--dist=mp"]}}, "must not set --distributed-executor-backend"),
        ({"prefill": {"tensorParallelSize": 0}}, "spec.prefill.tensorParallelSize must be an integer from 1 to 64"),
        ({"prefill": {"tensorParallelSize": -2}}, "spec.prefill.tensorParallelSize must be an integer from 1 to 64"),
        ({"decode": {"tensorParallelSize": 65}}, "spec.decode.tensorParallelSize must be an integer from 1 to 64"),
        ({"decode": {"tensorParallelSize": 2.0}}, "spec.decode.tensorParallelSize must be an integer"),
        ({"decode": {"tensorParallelSize": "2"}}, "spec.decode.tensorParallelSize must be an integer"),
        ({"decode": {"tensorParallelSize": True}}, "spec.decode.tensorParallelSize must be an integer"),
        ({"decode": {"tensorParallelSize": None}}, "spec.decode.tensorParallelSize must be an integer"),
        ({"prefill": {"shmSize": ""}}, "spec.prefill.shmSize must be a Kubernetes quantity"),
        ({"prefill": {"shmSize": "lots"}}, "spec.prefill.shmSize must be a Kubernetes quantity"),
        ({"decode": {"shmSize": "-1Gi"}}, "spec.decode.shmSize must be a Kubernetes quantity"),
        ({"decode": {"shmSize": 1024}}, "spec.decode.shmSize must be a Kubernetes quantity"),
        ({"decode": {"maxUnavailable": -1}}, "spec.decode.maxUnavailable must be an integer >= 0 or a percentage"),
        ({"decode": {"maxUnavailable": "half"}}, "spec.decode.maxUnavailable"),
        ({"prefill": {"maxUnavailable": True}}, "spec.prefill.maxUnavailable"),
        ({"prefill": {"affinity": ["zone"]}}, "spec.prefill.affinity must be an object"),
        ({"decode": {"topologySpreadConstraints": {"maxSkew": 1}}}, "topologySpreadConstraints must be a list"),
        ({"apiKeySecret": {"name": "Bad_Name"}}, "spec.apiKeySecret.name must be a Secret's name"),
        ({"apiKeySecret": {"name": "ok", "key": "a/b"}}, "spec.apiKeySecret.key must be a key of a Secret"),
        ({"apiKeySecret": "ok"}, "spec.apiKeySecret must be an object"),
        ({"router": {"args": ["--api-key", "k"]}}, "spec.router.args must not set --api-key (name a Secret"),
        ({"prefill": {"kvCache": "8Gi"}}, "spec.prefill.kvCache must be an object"),
        ({"prefill": {"kvCache": {"hostMemory": "lots"}}}, "spec.prefill.kvCache.hostMemory must be a Kubernetes"),
        ({"prefill": {"kvCache": {"hostMemory": "0"}}}, "spec.prefill.kvCache.hostMemory must be a Kubernetes"),
        ({"prefill": {"kvCache": {"hostMemory": 8}}}, "spec.prefill.kvCache.hostMemory must be a Kubernetes"),
        ({"decode": {"gpus": 0, "kvCache": {"hostMemory": "8Gi"}}}, "spec.decode.kvCache.hostMemory needs GPUs"),
        ({"decode": {"kvCache": {"disk": "50Gi"}}}, "spec.decode.kvCache.disk must be an object with a size"),
        ({"decode": {"kvCache": {"disk": {}}}}, "spec.decode.kvCache.disk.size must be a Kubernetes quantity"),
        ({"decode": {"kvCache": {"disk": {"size": "1"}}}}, "spec.decode.kvCache.disk.size"),  # 90% of 1 byte: 0
        ({"decode": {"kvCache": {"shared": "kv"}}}, "spec.decode.kvCache.shared must be an object with a claimName"),
        ({"decode": {"kvCache": {"shared": {"size": "1Gi"}}}}, "spec.decode.kvCache.shared.claimName must name"),
        ({"decode": {"kvCache": {"shared": {"claimName": "KV", "size": "1Gi"}}}}, "shared.claimName must name"),
        ({"decode": {"kvCache": {"shared": {"claimName": "kv"}}}}, "spec.decode.kvCache.shared.size is required"),
        ({"decode": {"kvCache": {"shared": {"claimName": "kv", "readOnly": "yes"}}}}, "shared.readOnly must be"),
        ({"decode": {"kvCache": {"shared": {"claimName": "kv", "size": "-1"}}}}, "spec.decode.kvCache.shared.size"),
        ({"decode": {"kvCache": {"disk": {"size": "1Gi"}, "maxAge": "a day"}}}, "spec.decode.kvCache.maxAge must be"),
        ({"decode": {"kvCache": {"disk": {"size": "1Gi"}, "maxAge": 0}}}, "spec.decode.kvCache.maxAge must be"),
        ({"decode": {"kvCache": {"disk": {"size": "1Gi"}, "maxAge": 1.5}}}, "spec.decode.kvCache.maxAge must be"),
        ({"decode": {"kvCache": {"hostMemory": "1Gi", "maxAge": "1h"}}}, "kvCache.maxAge needs disk or shared"),
        ({"decode": {"engineArgs": ["--kv-tier-host-bytes", "1GiB"]}}, "must not set --kv-tier-host-bytes"),
        ({"decode": {"engineArgs": ["--no-kv-tier-shared-read-only"]}}, "must not set --no-kv-tier-shared-read-only"),
        ({"decode": {"engineArgs": ["--kv-tier-max-age=60"]}}, "must not set --kv-tier-max-age"),
        ({"decode": {"engineArgs": ["--kv-tier-sh", "/x"]}}, "must not set --kv-tier-shared"),  # argparse prefix
        ({"decode": {"engineArgs": ["--api-key=k"]}}, "spec.decode.engineArgs must not set --api-key"),
    ],
)
def test_problems_name_the_field(fields, fragment):
    found = problems("llm", spec(**fields))
    assert any(fragment in problem for problem in found), found


@pytest.mark.parametrize(
    "flags", [["-tp", "2"], ["--tensor-parallel-size=4"], ["--distributed-executor-backend", "mp"]]
)
def test_tensor_parallel_flags_point_at_the_pool_field(flags):
    (found,) = problems("llm", spec(decode={"engineArgs": ["--max-model-len", "8192", *flags]}))
    assert found.startswith("spec.decode.engineArgs must not set ")
    assert found.endswith("(set spec.decode.tensorParallelSize instead)")


def test_flags_that_only_look_reserved_are_left_alone():
    # Values that start with a dash (a negative number, a lone "-") name no flag, and neither do
    # flags that merely share letters with a reserved one.
    args = ["--max-model-len", "8192", "--block-size", "-1", "--tokenizer", "-", "--max-num-seqs", "2"]
    assert problems("llm", spec(prefill={"engineArgs": args})) == []


@pytest.mark.parametrize(("gpus", "size"), [(1, 2), (2, 4), (3, 4), (63, 64)])
def test_fewer_gpus_than_ranks_is_invalid(gpus, size):
    assert problems("llm", spec(prefill={"gpus": gpus, "tensorParallelSize": size})) == [
        f"spec.prefill.gpus ({gpus}) must be 0 (CPU) or at least spec.prefill.tensorParallelSize ({size}): "
        "each tensor-parallel rank needs a GPU of its own"
    ]


def test_a_bad_size_is_reported_once():
    # No gpus-versus-ranks sentence on top of the size's own, whatever gpus says.
    found = problems("llm", spec(decode={"tensorParallelSize": 0, "gpus": 1}))
    assert found == ["spec.decode.tensorParallelSize must be an integer from 1 to 64"]
    assert problems("llm", spec(decode={"tensorParallelSize": 4, "gpus": -1})) == [
        "spec.decode.gpus must be an integer >= 0"
    ]


@pytest.mark.parametrize(
    ("size", "valid"),
    [(1, True), (2, True), (64, True), (0, False), (-1, False), (65, False), (1.5, False), ("2", False)],
)
def test_tensor_parallel_bounds_are_the_same_in_the_crd_and_the_operator(size, valid):
    fields = {"decode": {"tensorParallelSize": size, "gpus": 0}}
    assert (problems("llm", spec(**fields)) == []) is valid
    schema = spec_schema()["properties"]["decode"]["properties"]["tensorParallelSize"]
    in_schema = isinstance(size, int) and schema["minimum"] <= size <= schema["maximum"]
    assert in_schema is valid


@pytest.mark.parametrize(
    ("size", "valid"),
    [
        ("1Gi", True),
        ("512Mi", True),
        ("1.5Gi", True),
        ("2G", True),
        ("1073741824", True),
        ("1e9", True),
        ("", False),
        ("1 Gi", False),
        ("1gi", False),
        ("-1Gi", False),
        ("Gi", False),
        ("100m", False),
    ],
)
def test_shm_sizes_are_quantities_in_the_crd_and_the_operator(size, valid):
    assert (problems("llm", spec(decode={"shmSize": size})) == []) is valid
    schema = spec_schema()["properties"]["decode"]["properties"]["shmSize"]
    assert (re.search(schema["pattern"], size) is not None and len(size) >= schema["minLength"]) is valid


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


@pytest.mark.parametrize(
    "flags",
    [["--kv-tier-disk", "/data"], ["--kv-tier-shared-bytes=1GiB"], ["--kv-tier-shared-read-only"]],
)
def test_kv_tier_flags_point_at_the_pools_kv_cache(flags):
    (found,) = problems("llm", spec(prefill={"engineArgs": ["--max-model-len", "8192", *flags]}))
    assert found.startswith("spec.prefill.engineArgs must not set --kv-tier-")
    assert found.endswith("(set spec.prefill.kvCache instead)")


def test_a_shared_tier_read_only_needs_no_size():
    assert problems("llm", spec(decode={"kvCache": {"shared": {"claimName": "kv", "readOnly": True}}})) == []
    assert with_defaults(spec(decode={"kvCache": {"shared": {"claimName": "kv"}}}))["decode"]["kvCache"] == {
        "shared": {"claimName": "kv", "readOnly": False}
    }


def test_host_memory_follows_the_pools_gpus():
    tier = {"kvCache": {"hostMemory": "4Gi"}}
    assert problems("llm", spec(decode=tier)) == []  # gpus default to the tensor-parallel size: 1
    assert problems("llm", spec(decode={**tier, "tensorParallelSize": 2})) == []
    cpu = problems("llm", spec(decode={**tier, "tensorParallelSize": 2, "gpus": 0}))
    assert cpu == [
        "spec.decode.kvCache.hostMemory needs GPUs: with gpus 0 the engines run on the CPU, whose KV cache "
        "already is host memory"
    ]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("8Gi", 8 << 30),
        ("1.5Gi", 3 << 29),
        (".5Ki", 512),
        ("2G", 2 * 10**9),
        ("1k", 1000),
        ("1E", 10**18),  # exa, not an exponent
        ("1Ei", 1 << 60),
        ("1e9", 10**9),
        ("5E3", 5000),
        ("0.5", 1),  # rounded up, as the API server does
        ("1.", 1),
    ],
)
def test_quantities_in_bytes(text, size):
    assert quantity_bytes(text) == size


@pytest.mark.parametrize("text", ["", "Gi", "1 Gi", "1gi", "-1Gi", "100m", "1e19", "1e99999999", 5, None])
def test_what_is_no_quantity(text):
    with pytest.raises(ValueError):
        quantity_bytes(text)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(3600, 3600), ("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800), ("1h30m", 5400), ("1.5h", 5400)],
)
def test_durations_in_seconds(value, seconds):
    assert duration_seconds(value) == seconds


@pytest.mark.parametrize("value", ["", "12", "h", "1 h", "1w", "-1h", 1.5, True, None])
def test_what_is_no_duration(value):
    with pytest.raises(ValueError):
        duration_seconds(value)


@pytest.mark.parametrize(("size", "valid"), [("8Gi", True), ("1.5Gi", True), ("1e9", True), ("8GiB", False)])
def test_tier_sizes_are_quantities_in_the_crd_and_the_operator(size, valid):
    fields = {"hostMemory": size, "disk": {"size": size}, "shared": {"claimName": "kv", "size": size}}
    assert (problems("llm", spec(decode={"kvCache": fields})) == []) is valid
    tiers = spec_schema()["properties"]["decode"]["properties"]["kvCache"]["properties"]
    for schema in (tiers["hostMemory"], tiers["disk"]["properties"]["size"], tiers["shared"]["properties"]["size"]):
        assert (re.search(schema["pattern"], size) is not None) is valid
