"""``pagefleet.v1.SamplingParams`` (proto) <-> ``SamplingParams`` (engine), defaults in one place."""

from __future__ import annotations

from pagefleet.common.sampling_params import SamplingParams
from pagefleet.protos import generation_pb2 as pb


def from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """The engine's params for a proto message; unset fields take the engine's defaults."""
    d = SamplingParams()
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else d.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else d.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else d.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else d.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop) or None,
        stop_token_ids=list(msg.stop_token_ids) or None,
        ignore_eos=msg.ignore_eos,
    )


def to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop_strings),
        stop_token_ids=list(params.stop_token_ids or ()),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg
