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
        presence_penalty=msg.presence_penalty if msg.HasField("presence_penalty") else d.presence_penalty,
        frequency_penalty=msg.frequency_penalty if msg.HasField("frequency_penalty") else d.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else d.repetition_penalty,
        min_tokens=msg.min_tokens if msg.HasField("min_tokens") else d.min_tokens,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
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
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_tokens,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg
