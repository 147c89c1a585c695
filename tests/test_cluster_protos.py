"""The generated protobuf code is what the .proto files build, and the public names hold."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagefleet.protos import cluster_pb2, generation_pb2


@pytest.mark.timeout(60)
def test_generated_code_is_up_to_date():
    # In a process of its own: grpc_tools' protoc carries a protobuf runtime of its own, and a
    # process that loaded it aborts when NIXL's (the workers' KV transfer) loads after it.
    done = subprocess.run([sys.executable, "-m", "pagefleet.protos.build", "--check"], capture_output=True, text=True)
    assert done.returncode == 0, f"run: python -m pagefleet.protos.build\n{done.stdout}{done.stderr}"


def test_public_names():
    svc = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert generation_pb2.DESCRIPTOR.package == "pagefleet.v1"
    assert set(svc.methods_by_name) == {"Generate", "Cancel"}
    assert svc.methods_by_name["Generate"].server_streaming
    reasons = generation_pb2.FinishReason.keys()
    assert reasons == ["FINISH_REASON_UNSPECIFIED", "FINISH_REASON_STOP", "FINISH_REASON_LENGTH",
                       "FINISH_REASON_ABORT", "FINISH_REASON_ERROR"]
    assert set(cluster_pb2.DESCRIPTOR.services_by_name) == {"Worker", "Scheduler"}


def test_enum_values_carry_their_type_prefix():
    import re

    for module in (generation_pb2, cluster_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
            assert all(v.name.startswith(prefix) for v in enum.values), enum.name
            assert enum.values[0].number == 0 and enum.values[0].name.endswith("UNSPECIFIED")


def test_optional_where_zero_means_something():
    fields = generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert fields[name].has_presence, name
