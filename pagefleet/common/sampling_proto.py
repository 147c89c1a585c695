"""``pagefleet.v1.SamplingParams`` (proto) <-> ``SamplingParams`` (engine), defaults in one place."""

from __future__ import annotations

from pagefleet.common.sampling_params import SamplingParams, StructuredOutputs
from pagefleet.protos import generation_pb2 as pb


def from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """The engine's params for a proto message; unset fields take the engine's defaults."""
    d = SamplingParams()
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else d.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else d.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else d.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else d.top_k,
        min_p=msg.min_p if msg.HasField("min_p") else d.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop) or None,
        stop_token_ids=list(msg.stop_token_ids) or None,
        ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty if msg.HasField("presence_penalty") else d.presence_penalty,
        frequency_penalty=msg.frequency_penalty if msg.HasField("frequency_penalty") else d.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else d.repetition_penalty,
        min_tokens=msg.min_tokens if msg.HasField("min_tokens") else d.min_tokens,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        bad_words_token_ids=[list(w.ids) for w in msg.bad_words_token_ids] or None,
        structured_outputs=_structured_or_none(msg),
    )


def _structured_or_none(msg: pb.SamplingParams) -> StructuredOutputs | None:
    """The message's constraint; None when none is set, its message present but empty included
    ("at most one of these is set": a builder that fills every sub-message sends it empty)."""
    if not msg.HasField("structured_outputs"):
        return None
    so = structured_from_proto(msg.structured_outputs)
    return so if so.num_set else None


def structured_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputs:
    return StructuredOutputs(
        json=msg.json if msg.HasField("json") else None,
        regex=msg.regex if msg.HasField("regex") else None,
        choice=tuple(msg.choice) or None,
        grammar=msg.grammar if msg.HasField("grammar") else None,
        json_object=msg.json_object,
    )


def structured_to_proto(so: StructuredOutputs) -> pb.StructuredOutputs:
    msg = pb.StructuredOutputs(choice=list(so.choice or ()), json_object=so.json_object)
    for name in ("json", "regex", "grammar"):
        if getattr(so, name) is not None:
            setattr(msg, name, getattr(so, name))
    return msg


def to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        stop=list(params.stop_strings),
        stop_token_ids=list(params.stop_token_ids or ()),
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        logit_bias=params.logit_bias or {},
        allowed_token_ids=params.allowed_token_ids or [],
        bad_words_token_ids=[pb.TokenIds(ids=w) for w in params.bad_words_token_ids or ()],
    )
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_to_proto(params.structured_outputs))
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg
