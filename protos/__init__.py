"""``pagefleet.v1`` protobuf definitions and the code generated from them (``python -m pagefleet.protos.build``)."""
